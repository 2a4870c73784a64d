//! Signing secrets: made here (`whsec_` + base64 of 32 random bytes, Standard Webhooks'
//! form) and stored encrypted with AES-256-GCM under the process's key
//! (`ONCEPAY_WEBHOOK_SECRET_KEY`). The tenant's id is the associated data: a ciphertext
//! copied onto another tenant's endpoint does not decrypt.
//!
//! Without the key (a new installation, a test) webhooks still work, as docs/webhooks.md
//! promises, but the secrets are stored as they are, and the server says so in its log at
//! start-up: a database dump alone could then sign (docs/security.md). Each stored value
//! says which it is (its first byte), so a key set later still opens the secrets stored
//! before it, and seals every new one.

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use rand::RngCore as _;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};

/// The prefix of a secret as shown to the tenant.
pub const PREFIX: &str = "whsec_";

/// The first byte of a stored secret: how the rest is to be read.
const STORED_PLAIN: u8 = 0;
const STORED_AES_256_GCM: u8 = 1;

/// The process's key for the stored secrets (`None`: stored unencrypted).
pub struct SecretBox {
    key: Option<LessSafeKey>,
}

/// A stored secret that does not open here (sealed, and this process has another key or
/// none; or tampered with).
#[derive(Debug, thiserror::Error)]
#[error("a stored webhook secret does not decrypt with this server's ONCEPAY_WEBHOOK_SECRET_KEY")]
pub struct Undecryptable;

impl SecretBox {
    pub fn new(key: Option<&[u8; 32]>) -> Self {
        Self {
            key: key
                .map(|key| LessSafeKey::new(UnboundKey::new(&AES_256_GCM, key).expect("32 bytes is an AES-256 key"))),
        }
    }

    /// Whether new secrets are stored encrypted.
    pub fn encrypts(&self) -> bool {
        self.key.is_some()
    }

    /// A new secret, `whsec_...`.
    pub fn generate() -> String {
        let mut bytes = [0u8; 32];
        rand::rngs::OsRng.fill_bytes(&mut bytes);
        format!("{PREFIX}{}", STANDARD.encode(bytes))
    }

    /// With a key: `1 || nonce || ciphertext || tag`; without: `0 || secret`.
    pub fn seal(&self, tenant: uuid::Uuid, secret: &str) -> Vec<u8> {
        let Some(key) = &self.key else {
            let mut out = vec![STORED_PLAIN];
            out.extend_from_slice(secret.as_bytes());
            return out;
        };
        let mut nonce = [0u8; NONCE_LEN];
        rand::rngs::OsRng.fill_bytes(&mut nonce);
        let mut sealed = secret.as_bytes().to_vec();
        key.seal_in_place_append_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(tenant.as_bytes()),
            &mut sealed,
        )
        .expect("a secret is far below AES-GCM's length limit");
        let mut out = vec![STORED_AES_256_GCM];
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        out
    }

    pub fn open(&self, tenant: uuid::Uuid, stored: &[u8]) -> Result<String, Undecryptable> {
        let plain = match stored.split_first() {
            Some((&STORED_PLAIN, secret)) => secret.to_vec(),
            Some((&STORED_AES_256_GCM, rest)) if rest.len() >= NONCE_LEN => {
                let key = self.key.as_ref().ok_or(Undecryptable)?;
                let (nonce, sealed) = rest.split_at(NONCE_LEN);
                let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| Undecryptable)?;
                let mut buffer = sealed.to_vec();
                key.open_in_place(nonce, Aad::from(tenant.as_bytes()), &mut buffer)
                    .map_err(|_| Undecryptable)?
                    .to_vec()
            }
            _ => return Err(Undecryptable),
        };
        String::from_utf8(plain).map_err(|_| Undecryptable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_secret_opens_only_with_its_key_and_tenant() {
        let sealer = SecretBox::new(Some(&[7; 32]));
        let secret = SecretBox::generate();
        assert!(secret.starts_with(PREFIX));
        assert_eq!(STANDARD.decode(&secret[PREFIX.len()..]).unwrap().len(), 32);
        let tenant = uuid::Uuid::new_v4();
        let stored = sealer.seal(tenant, &secret);
        assert!(!stored.windows(secret.len()).any(|w| w == secret.as_bytes()));
        assert_eq!(sealer.open(tenant, &stored).unwrap(), secret);
        assert!(sealer.open(uuid::Uuid::new_v4(), &stored).is_err());
        assert!(SecretBox::new(Some(&[8; 32])).open(tenant, &stored).is_err());
        assert!(
            SecretBox::new(None).open(tenant, &stored).is_err(),
            "sealed needs the key"
        );
        let mut tampered = stored.clone();
        *tampered.last_mut().unwrap() ^= 1;
        assert!(sealer.open(tenant, &tampered).is_err());
    }

    #[test]
    fn without_a_key_a_secret_is_stored_as_it_is_and_opens_with_or_without_one_later() {
        let tenant = uuid::Uuid::new_v4();
        let secret = SecretBox::generate();
        let plain = SecretBox::new(None);
        assert!(!plain.encrypts());
        let stored = plain.seal(tenant, &secret);
        assert_eq!(&stored[1..], secret.as_bytes());
        assert_eq!(plain.open(tenant, &stored).unwrap(), secret);
        assert_eq!(SecretBox::new(Some(&[7; 32])).open(tenant, &stored).unwrap(), secret);
        assert!(plain.open(tenant, &[]).is_err());
        assert!(plain.open(tenant, &[9, 1, 2]).is_err());
    }
}
