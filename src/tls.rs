//! HTTPS for `serve`: the rustls configuration built from the PEM files named by
//! `ONCEPAY_TLS_CERT` (the certificate chain, leaf first) and `ONCEPAY_TLS_KEY` (its private
//! key). TLS 1.3 and 1.2 only: rustls implements nothing older.

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::ServerConfig;

/// Reads the chain and the key; any fault is a start-up error naming the file.
pub fn server_config(cert: &Path, key: &Path) -> anyhow::Result<ServerConfig> {
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .with_context(|| {
            format!(
                "ONCEPAY_TLS_CERT={}: cannot read a PEM certificate chain",
                cert.display()
            )
        })?;
    if chain.is_empty() {
        bail!("ONCEPAY_TLS_CERT={} holds no certificate", cert.display());
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("ONCEPAY_TLS_KEY={}: cannot read a PEM private key", key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .context("TLS 1.2 and 1.3 with the ring provider")?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .context("ONCEPAY_TLS_CERT and ONCEPAY_TLS_KEY do not make a usable pair")
}
