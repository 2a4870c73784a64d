//! `https://`: the system's roots, plus the roots of `ONCEPAY_CA_CERT` and of the caller
//! ([`crate::ClientBuilder::add_root_certificates_pem`]). A certificate that does not verify
//! ends the call at once: the handshake failed, so no byte of the request was sent, and a
//! retry would meet the same certificate.

use std::error::Error as StdError;

use reqwest::Certificate;

use crate::error::ClientError;
use crate::CA_CERT_ENV;

/// The extra roots: the caller's PEM bundles, then the file named by `ONCEPAY_CA_CERT`.
pub(crate) fn extra_roots(bundles: Vec<Vec<u8>>) -> Result<Vec<Certificate>, ClientError> {
    let mut labelled: Vec<(String, Vec<u8>)> = bundles
        .into_iter()
        .map(|pem| ("the extra roots given to the builder".to_owned(), pem))
        .collect();
    if let Some(path) = std::env::var_os(CA_CERT_ENV).filter(|path| !path.is_empty()) {
        let label = format!("{CA_CERT_ENV}={}", path.to_string_lossy());
        let pem = std::fs::read(&path).map_err(|e| ClientError::InvalidArgument(format!("{label}: {e}")))?;
        labelled.push((label, pem));
    }
    let mut roots = Vec::new();
    for (label, pem) in labelled {
        match Certificate::from_pem_bundle(&pem) {
            Ok(certificates) if !certificates.is_empty() => roots.extend(certificates),
            _ => {
                return Err(ClientError::InvalidArgument(format!(
                    "{label}: not a PEM bundle of certificates"
                )))
            }
        }
    }
    Ok(roots)
}

/// Whether a failed send is the handshake refusing the server's certificate: nothing was
/// sent, and a retry would meet the same certificate.
pub(crate) fn handshake_refused(error: &reqwest::Error) -> bool {
    error.source().and_then(rustls_cause).is_some_and(|cause| {
        matches!(
            cause,
            rustls::Error::InvalidCertificate(_)
                | rustls::Error::NoCertificatesPresented
                | rustls::Error::UnsupportedNameType
        )
    })
}

/// The rustls error among the causes. It travels inside io::Errors (nested ones, too),
/// whose `source()` skips the error they wrap: those are opened with `get_ref()`.
fn rustls_cause<'e>(error: &'e (dyn StdError + 'static)) -> Option<&'e rustls::Error> {
    if let Some(rustls) = error.downcast_ref::<rustls::Error>() {
        return Some(rustls);
    }
    let wrapped = error
        .downcast_ref::<std::io::Error>()
        .and_then(|io| io.get_ref())
        .and_then(|inner| rustls_cause(inner));
    wrapped.or_else(|| error.source().and_then(rustls_cause))
}

#[cfg(test)]
mod tests {
    use crate::Client;

    #[test]
    fn https_and_http_urls_are_accepted_and_other_schemes_refused() {
        for url in ["https://pay.example.com", "http://127.0.0.1:8130/prefix"] {
            assert!(Client::builder(url, "k").build().is_ok(), "{url}");
        }
        let err = Client::builder("ftp://pay.example.com", "k")
            .build()
            .err()
            .expect("refused");
        assert_eq!(err.code(), "invalid_argument");
    }

    #[test]
    fn extra_roots_that_hold_no_certificate_are_refused_when_the_client_is_built() {
        let err = Client::builder("https://pay.example.com", "k")
            .add_root_certificates_pem(b"not a certificate")
            .build()
            .err()
            .expect("refused");
        assert_eq!(err.code(), "invalid_argument");
        assert!(err.to_string().contains("not a PEM bundle"), "{err}");
    }
}
