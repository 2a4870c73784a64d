//! Which URLs may receive webhooks. A URL is `http` or `https` with a host; unless the
//! operator allows private targets (`ONCEPAY_WEBHOOK_ALLOW_PRIVATE=1`), every address it
//! resolves to must be global unicast ([`is_global`]): no loopback, private, shared,
//! link-local, site-local, documentation, benchmarking or other special-purpose address, and
//! an IPv4 address spelled inside an IPv6 one (mapped, translated, NAT64, 6to4) is judged as
//! the IPv4 address it is. Checked when the endpoint is registered (an asynchronous lookup
//! bounded by [`LOOKUP_TIMEOUT`]), and again on every connection a delivery makes: the
//! deliveries' HTTP client resolves through [`GuardedResolver`], which refuses such addresses,
//! so a name that resolved to a public address at registration and to 127.0.0.1 later (DNS
//! rebinding) reaches nothing; and it uses no proxy, which would resolve the name itself.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use reqwest::Url;

/// The longest a registration waits for its URL's host to resolve.
pub const LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

/// Why a URL is refused (the detail of a 400).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Refused {
    #[error("`url` must be an absolute http or https URL with a host")]
    Malformed,
    #[error("`url` must be at most {MAX_URL_BYTES} bytes long")]
    TooLong,
    #[error("`url` must not carry a user name or password")]
    Credentials,
    /// Found from outside: `http://127.0.0.1:0/x` was stored, and every delivery failed.
    #[error("`url`'s port must be from 1 to 65535 (0 names no port a receiver can listen on)")]
    PortZero,
    /// Found from outside: `https://host/x#frag` was stored as it was; HTTP never sends a
    /// fragment, so the receiver never saw what the merchant named.
    #[error("`url` must not carry a fragment (`#...`): HTTP never sends it to the receiver")]
    Fragment,
    #[error("`url` must not contain control characters (NUL, CR, LF, tab, ...) or begin or end with a space")]
    ControlCharacters,
    #[error("`url` resolves to an address that is not global unicast ({0}: loopback, private, link-local or another special-purpose range), which webhooks may not target")]
    Private(IpAddr),
    #[error("`url`'s host does not resolve")]
    Unresolved,
    #[error("`url`'s host did not resolve within {} seconds", LOOKUP_TIMEOUT.as_secs())]
    LookupTimedOut,
}

/// The longest URL an endpoint may have (as sent, before parsing).
pub const MAX_URL_BYTES: usize = 2048;

/// Parses and checks the form of a URL (not yet its addresses).
pub fn parse(raw: &str) -> Result<Url, Refused> {
    if raw.len() > MAX_URL_BYTES {
        return Err(Refused::TooLong);
    }
    // A URL parser drops these silently (leading and trailing ones, tabs and newlines
    // anywhere): `x\r\nX-Evil: 1` was stored as `xX-Evil:%201`. Refused, not rewritten.
    if raw.chars().any(char::is_control) || raw.trim() != raw {
        return Err(Refused::ControlCharacters);
    }
    let url = Url::parse(raw).map_err(|_| Refused::Malformed)?;
    if !matches!(url.scheme(), "http" | "https") || url.host().is_none() || url.cannot_be_a_base() {
        return Err(Refused::Malformed);
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(Refused::Credentials);
    }
    if url.port() == Some(0) {
        return Err(Refused::PortZero);
    }
    if url.fragment().is_some() {
        return Err(Refused::Fragment);
    }
    Ok(url)
}

/// Whether an address is global unicast, the only kind webhooks may target without
/// `ONCEPAY_WEBHOOK_ALLOW_PRIVATE` (IANA's special-purpose registries, RFC 6890 and its
/// successors). IPv6 is allowed only inside 2000::/3, less its special ranges; an IPv4
/// address inside an IPv6 one is unwrapped and judged as IPv4.
pub fn is_global(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_global_v4(v4),
        IpAddr::V6(v6) => match embedded_v4(v6) {
            Some(Embedded::V4(v4)) => is_global_v4(v4),
            Some(Embedded::Refused) => false,
            None => is_global_v6(v6),
        },
    }
}

fn is_global_v4(v4: Ipv4Addr) -> bool {
    let [a, b, c, _] = v4.octets();
    !(a == 0 // "this network"
        || a == 10 // private
        || (a == 100 && (64..128).contains(&b)) // shared address space (CGNAT)
        || a == 127 // loopback
        || (a == 169 && b == 254) // link-local, the cloud metadata address among them
        || (a == 172 && (16..32).contains(&b)) // private
        || (a == 192 && b == 0 && c == 0) // IETF protocol assignments
        || (a == 192 && b == 0 && c == 2) // documentation (TEST-NET-1)
        || (a == 192 && b == 88 && c == 99) // 6to4 relay anycast
        || (a == 192 && b == 168) // private
        || (a == 198 && (18..20).contains(&b)) // benchmarking
        || (a == 198 && b == 51 && c == 100) // documentation (TEST-NET-2)
        || (a == 203 && b == 0 && c == 113) // documentation (TEST-NET-3)
        || a >= 224) // multicast, reserved, broadcast
}

/// What an IPv6 address that carries an IPv4 one stands for.
enum Embedded {
    V4(Ipv4Addr),
    /// A form that is not to be reached at all (IPv4-compatible, deprecated; local-use NAT64;
    /// Teredo, whose IPv4 address is obfuscated).
    Refused,
}

fn embedded_v4(v6: Ipv6Addr) -> Option<Embedded> {
    let s = v6.segments();
    let low = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    match s {
        // ::ffff:a.b.c.d, IPv4-mapped.
        [0, 0, 0, 0, 0, 0xffff, _, _] => Some(Embedded::V4(low)),
        // ::ffff:0:a.b.c.d, IPv4-translated (SIIT).
        [0, 0, 0, 0, 0xffff, 0, _, _] => Some(Embedded::V4(low)),
        // 64:ff9b::a.b.c.d, the well-known NAT64 prefix.
        [0x64, 0xff9b, 0, 0, 0, 0, _, _] => Some(Embedded::V4(low)),
        // 64:ff9b:1::/48, NAT64 for local use.
        [0x64, 0xff9b, 1, ..] => Some(Embedded::Refused),
        // 2002:AABB:CCDD::/48, 6to4.
        [0x2002, hi, lo, ..] => Some(Embedded::V4(Ipv4Addr::new(
            (hi >> 8) as u8,
            hi as u8,
            (lo >> 8) as u8,
            lo as u8,
        ))),
        // 2001::/32, Teredo.
        [0x2001, 0, ..] => Some(Embedded::Refused),
        // ::a.b.c.d, IPv4-compatible (deprecated); :: and ::1 are judged below.
        [0, 0, 0, 0, 0, 0, hi, _] if hi != 0 => Some(Embedded::Refused),
        _ => None,
    }
}

fn is_global_v6(v6: Ipv6Addr) -> bool {
    let s = v6.segments();
    // Global unicast is 2000::/3; everything else (::, ::1, 100::/64 discard, fc00::/7 unique
    // local, fe80::/10 link-local, fec0::/10 site-local, ff00::/8 multicast) is not.
    let special = match s[0] {
        // 2001::/23, IETF protocol assignments; 2001:db8::/32, documentation.
        0x2001 => s[1] < 0x0200 || s[1] == 0x0db8,
        // 3fff::/20, documentation.
        first => (first & 0xfff0) == 0x3ff0,
    };
    (s[0] & 0xe000) == 0x2000 && !special
}

/// Checks every address the URL's host resolves to (a literal address without a lookup; a
/// name through the system's resolver on tokio's blocking pool, never on the caller's
/// thread, and within [`LOOKUP_TIMEOUT`]).
pub async fn check(url: &Url, allow_private: bool) -> Result<(), Refused> {
    let host = url.host_str().ok_or(Refused::Malformed)?;
    let host = host.trim_start_matches('[').trim_end_matches(']').to_owned();
    let port = url.port_or_known_default().unwrap_or(443);
    let lookup = async move {
        tokio::net::lookup_host((host.as_str(), port))
            .await
            .map(|addrs| addrs.map(|a| a.ip()).collect::<Vec<_>>())
    };
    let literal = url
        .host_str()
        .and_then(|h| h.trim_start_matches('[').trim_end_matches(']').parse().ok());
    match literal {
        Some(ip) => check_addresses(&[ip], allow_private),
        None => check_lookup(lookup, LOOKUP_TIMEOUT, allow_private).await,
    }
}

/// The addresses `lookup` gives, within `timeout`, checked.
async fn check_lookup(
    lookup: impl Future<Output = std::io::Result<Vec<IpAddr>>>,
    timeout: Duration,
    allow_private: bool,
) -> Result<(), Refused> {
    let addrs = tokio::time::timeout(timeout, lookup)
        .await
        .map_err(|_| Refused::LookupTimedOut)?
        .map_err(|_| Refused::Unresolved)?;
    check_addresses(&addrs, allow_private)
}

fn check_addresses(addrs: &[IpAddr], allow_private: bool) -> Result<(), Refused> {
    if addrs.is_empty() {
        return Err(Refused::Unresolved);
    }
    if !allow_private {
        if let Some(ip) = addrs.iter().find(|ip| !is_global(**ip)) {
            return Err(Refused::Private(*ip));
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
                .filter(|a| allow_private || is_global(a.ip()))
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
    fn only_global_unicast_addresses_are_global() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "0.1.2.3",
            "192.0.0.8",
            "192.0.2.1",
            "192.88.99.1",
            "198.18.0.1",
            "198.19.255.255",
            "198.51.100.7",
            "203.0.113.9",
            "224.0.0.1",
            "240.0.0.1",
            "255.255.255.255",
            "::",
            "::1",
            "fe80::1",
            "fd00::1",
            "fec0::1",
            "ff02::1",
            "100::1",
            "2001:db8::1",
            "3fff::1",
            "2001::1",
            "2001:2::1",
            // IPv4 inside IPv6: mapped, compatible, translated, NAT64, 6to4.
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "::127.0.0.1",
            "::1.1.1.1",
            "::ffff:0:7f00:1",
            "64:ff9b::7f00:1",
            "64:ff9b::a9fe:a9fe",
            "64:ff9b:1::1.1.1.1",
            "2002:7f00:1::1",
            "2002:a00:1::1",
        ] {
            assert!(!is_global(ip.parse().unwrap()), "{ip}");
        }
        for ip in [
            "93.184.216.34",
            "1.1.1.1",
            "8.8.8.8",
            "198.20.0.1",
            "2606:4700::1111",
            "2a00:1450:4001::1",
            "::ffff:1.1.1.1",
            "64:ff9b::101:101",
            "2002:101:101::1",
        ] {
            assert!(is_global(ip.parse().unwrap()), "{ip}");
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
        for zero in [
            "http://127.0.0.1:0/x",
            "https://example.com:0/",
            "https://example.com:00/",
        ] {
            assert_eq!(parse(zero).unwrap_err(), Refused::PortZero, "{zero}");
        }
        assert!(parse("https://example.com:65535/").is_ok());
        for fragment in ["https://example.com/x#frag", "https://example.com/#"] {
            assert_eq!(parse(fragment).unwrap_err(), Refused::Fragment, "{fragment}");
        }
        assert!(parse("https://example.com/x?a=1").is_ok(), "a query is sent: kept");
        let longest = format!("https://example.com/{}", "a".repeat(MAX_URL_BYTES - 20));
        assert!(parse(&longest).is_ok());
        assert_eq!(parse(&format!("{longest}a")).unwrap_err(), Refused::TooLong);
        for rewritten in [
            "https://example.com/x\r\nX-Evil: 1",
            "https://example.com/x\0",
            "https://exa\tmple.com/",
            " https://example.com/",
            "https://example.com/ ",
        ] {
            assert_eq!(
                parse(rewritten).unwrap_err(),
                Refused::ControlCharacters,
                "{rewritten:?}"
            );
        }
    }

    #[tokio::test]
    async fn private_addresses_are_refused_unless_allowed() {
        let url = parse("http://127.0.0.1:9/x").unwrap();
        assert!(matches!(check(&url, false).await, Err(Refused::Private(_))));
        assert!(check(&url, true).await.is_ok());
        for literal in [
            "http://[::1]:9/x",
            "http://[64:ff9b::7f00:1]/",
            "http://[::ffff:0:7f00:1]/",
        ] {
            let url = parse(literal).unwrap();
            assert!(
                matches!(check(&url, false).await, Err(Refused::Private(_))),
                "{literal}"
            );
        }
        let url = parse("http://localhost:9/x").unwrap();
        assert!(matches!(check(&url, false).await, Err(Refused::Private(_))));
    }

    #[tokio::test]
    async fn a_lookup_that_never_answers_is_refused_after_the_timeout() {
        let started = std::time::Instant::now();
        let never = std::future::pending::<std::io::Result<Vec<IpAddr>>>();
        let refused = check_lookup(never, Duration::from_millis(50), false).await;
        assert_eq!(refused, Err(Refused::LookupTimedOut));
        assert!(started.elapsed() < Duration::from_secs(5), "bounded by its timeout");
        let found = async { Ok(vec!["1.1.1.1".parse().unwrap()]) };
        assert_eq!(check_lookup(found, Duration::from_millis(50), false).await, Ok(()));
        let failed = async { Err(std::io::Error::other("no such host")) };
        assert_eq!(
            check_lookup(failed, Duration::from_millis(50), false).await,
            Err(Refused::Unresolved)
        );
    }
}
