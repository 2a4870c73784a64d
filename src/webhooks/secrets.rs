//! Signing secrets: made here (`whsec_` + base64 of 32 random bytes, Standard Webhooks'
//! form), stored only encrypted with AES-256-GCM under the process's key
//! (`ONCEPAY_WEBHOOK_SECRET_KEY`). The tenant's id is the associated data: a ciphertext
//! copied onto another tenant's endpoint does not decrypt.

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use rand::RngCore as _;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};

/// The prefix of a secret as shown to the tenant.
pub const PREFIX: &str = "whsec_";

/// The process's key for the stored secrets.
pub struct SecretBox {
    key: LessSafeKey,
}

/// A stored secret that does not decrypt with this key (another key, or tampered with).
#[derive(Debug, thiserror::Error)]
#[error("a stored webhook secret does not decrypt with ONCEPAY_WEBHOOK_SECRET_KEY")]
pub struct Undecryptable;

impl SecretBox {
    pub fn new(key: &[u8; 32]) -> Self {
        let key = UnboundKey::new(&AES_256_GCM, key).expect("32 bytes is an AES-256 key");
        Self {
            key: LessSafeKey::new(key),
        }
    }

    /// A new secret, `whsec_...`.
    pub fn generate() -> String {
        let mut bytes = [0u8; 32];
        rand::rngs::OsRng.fill_bytes(&mut bytes);
        format!("{PREFIX}{}", STANDARD.encode(bytes))
    }

    /// `nonce || ciphertext || tag`.
    pub fn seal(&self, tenant: uuid::Uuid, secret: &str) -> Vec<u8> {
        let mut nonce = [0u8; NONCE_LEN];
        rand::rngs::OsRng.fill_bytes(&mut nonce);
        let mut sealed = secret.as_bytes().to_vec();
        self.key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(tenant.as_bytes()),
                &mut sealed,
            )
            .expect("a secret is far below AES-GCM's length limit");
        let mut out = nonce.to_vec();
        out.extend_from_slice(&sealed);
        out
    }

    pub fn open(&self, tenant: uuid::Uuid, stored: &[u8]) -> Result<String, Undecryptable> {
        if stored.len() < NONCE_LEN {
            return Err(Undecryptable);
        }
        let (nonce, sealed) = stored.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| Undecryptable)?;
        let mut buffer = sealed.to_vec();
        let plain = self
            .key
            .open_in_place(nonce, Aad::from(tenant.as_bytes()), &mut buffer)
            .map_err(|_| Undecryptable)?;
        String::from_utf8(plain.to_vec()).map_err(|_| Undecryptable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_secret_opens_only_with_its_key_and_tenant() {
        let sealer = SecretBox::new(&[7; 32]);
        let secret = SecretBox::generate();
        assert!(secret.starts_with(PREFIX));
        assert_eq!(STANDARD.decode(&secret[PREFIX.len()..]).unwrap().len(), 32);
        let tenant = uuid::Uuid::new_v4();
        let stored = sealer.seal(tenant, &secret);
        assert!(!stored.windows(secret.len()).any(|w| w == secret.as_bytes()));
        assert_eq!(sealer.open(tenant, &stored).unwrap(), secret);
        assert!(sealer.open(uuid::Uuid::new_v4(), &stored).is_err());
        assert!(SecretBox::new(&[8; 32]).open(tenant, &stored).is_err());
        let mut tampered = stored.clone();
        *tampered.last_mut().unwrap() ^= 1;
        assert!(sealer.open(tenant, &tampered).is_err());
    }
}
