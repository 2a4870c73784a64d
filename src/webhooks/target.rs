//! Which URLs may receive webhooks. A URL is `http` or `https` with a host; unless the
//! operator allows private targets (`ONCEPAY_WEBHOOK_ALLOW_PRIVATE=1`), every address it
//! resolves to must be public: no loopback, private (RFC 1918, fc00::/7), link-local
//! (169.254/16 with the cloud metadata address, fe80::/10), shared (100.64/10), unspecified,
//! multicast or broadcast address. Checked when the endpoint is registered, and again on
//! every connection a delivery makes: the deliveries' HTTP client resolves through
//! [`GuardedResolver`], which refuses such addresses, so a name that resolved to a public
//! address at registration and to 127.0.0.1 later (DNS rebinding) reaches nothing.

use std::net::{IpAddr, SocketAddr};

use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use reqwest::Url;

/// Why a URL is refused (the detail of a 400).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Refused {
    #[error("`url` must be an absolute http or https URL with a host")]
    Malformed,
    #[error("`url` must not carry a user name or password")]
    Credentials,
    #[error("`url` resolves to a loopback, private or link-local address ({0}), which webhooks may not target")]
    Private(IpAddr),
    #[error("`url`'s host does not resolve")]
    Unresolved,
}

/// Parses and checks the form of a URL (not yet its addresses).
pub fn parse(raw: &str) -> Result<Url, Refused> {
    if raw.len() > 2048 {
        return Err(Refused::Malformed);
    }
    let url = Url::parse(raw).map_err(|_| Refused::Malformed)?;
    if !matches!(url.scheme(), "http" | "https") || url.host().is_none() || url.cannot_be_a_base() {
        return Err(Refused::Malformed);
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(Refused::Credentials);
    }
    Ok(url)
}

/// Whether an address is one webhooks may target without `ONCEPAY_WEBHOOK_ALLOW_PRIVATE`.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                || a == 0
                || (a == 100 && (64..128).contains(&b)) // shared address space (CGNAT)
                || a >= 240)
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public(IpAddr::V4(v4));
            }
            let first = v6.segments()[0];
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (first & 0xfe00) == 0xfc00 // unique local
                || (first & 0xffc0) == 0xfe80) // link-local
        }
    }
}

/// Checks every address the URL's host resolves to (a literal address without a lookup;
/// a name with the system's resolver, blocking).
pub fn check_blocking(url: &Url, allow_private: bool) -> Result<(), Refused> {
    use std::net::ToSocketAddrs as _;
    let host = url.host_str().ok_or(Refused::Malformed)?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port = url.port_or_known_default().unwrap_or(443);
    let addrs: Vec<IpAddr> = match host.parse::<IpAddr>() {
        Ok(ip) => vec![ip],
        Err(_) => (host, port)
            .to_socket_addrs()
            .map_err(|_| Refused::Unresolved)?
            .map(|a| a.ip())
            .collect(),
    };
    if addrs.is_empty() {
        return Err(Refused::Unresolved);
    }
    if !allow_private {
        if let Some(ip) = addrs.into_iter().find(|ip| !is_public(*ip)) {
            return Err(Refused::Private(ip));
        }
    }
    Ok(())
}

/// The deliveries' resolver: the system's, with every non-public address refused unless
/// private targets are allowed. A host whose every address is refused fails the connection.
#[derive(Clone, Copy, Debug)]
pub struct GuardedResolver {
    pub allow_private: bool,
}

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let allow_private = self.allow_private;
        Box::pin(async move {
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((name.as_str(), 0))
                .await?
                .filter(|a| allow_private || is_public(a.ip()))
                .collect();
            if addrs.is_empty() {
                return Err(format!("{} resolves to no address webhooks may target", name.as_str()).into());
            }
            Ok(Box::new(addrs.into_iter()) as Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_loopback_and_link_local_addresses_are_not_public() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "::1",
            "fe80::1",
            "fd00::1",
            "::ffff:127.0.0.1",
            "255.255.255.255",
        ] {
            assert!(!is_public(ip.parse().unwrap()), "{ip}");
        }
        for ip in ["93.184.216.34", "1.1.1.1", "2606:4700::1111"] {
            assert!(is_public(ip.parse().unwrap()), "{ip}");
        }
    }

    #[test]
    fn only_http_urls_with_a_host_and_no_credentials() {
        assert!(parse("https://example.com/hook").is_ok());
        assert!(parse("http://1.1.1.1:8080/x").is_ok());
        assert_eq!(parse("ftp://example.com/").unwrap_err(), Refused::Malformed);
        assert_eq!(parse("mailto:a@b.c").unwrap_err(), Refused::Malformed);
        assert_eq!(parse("/relative").unwrap_err(), Refused::Malformed);
        assert_eq!(parse("https://u:p@example.com/").unwrap_err(), Refused::Credentials);
    }

    #[test]
    fn private_addresses_are_refused_unless_allowed() {
        let url = parse("http://127.0.0.1:9/x").unwrap();
        assert!(matches!(check_blocking(&url, false), Err(Refused::Private(_))));
        assert!(check_blocking(&url, true).is_ok());
        let url = parse("http://[::1]:9/x").unwrap();
        assert!(matches!(check_blocking(&url, false), Err(Refused::Private(_))));
        let url = parse("http://localhost:9/x").unwrap();
        assert!(matches!(check_blocking(&url, false), Err(Refused::Private(_))));
    }
}
