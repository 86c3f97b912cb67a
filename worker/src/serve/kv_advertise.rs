//! Where prefill workers reach a decode worker's KV listener (`--kv-advertise`): an address,
//! or an IP alone at the listener's own port. The IP alone is what a Kubernetes pod is told of
//! itself (the downward API's `status.podIP`): an IPv6 one cannot be followed by `:port`
//! without brackets, which the manifest cannot add.

use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;

/// `--kv-advertise`: an address, or an IP at the KV listener's port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvAdvertise {
    Addr(SocketAddr),
    Ip(IpAddr),
}

impl KvAdvertise {
    /// The address advertised for a KV listener bound at `listener`.
    pub fn at(self, listener: SocketAddr) -> SocketAddr {
        match self {
            KvAdvertise::Addr(addr) => addr,
            KvAdvertise::Ip(ip) => SocketAddr::new(ip, listener.port()),
        }
    }
}

impl FromStr for KvAdvertise {
    type Err = String;

    fn from_str(s: &str) -> Result<KvAdvertise, String> {
        if let Ok(addr) = s.parse() {
            return Ok(KvAdvertise::Addr(addr));
        }
        s.parse().map(KvAdvertise::Ip).map_err(|_| {
            format!(
                "{s:?} is neither an address like 10.1.2.3:50061 or [fd00::5]:50061 nor an IP \
                 (advertised at the KV listener's port)"
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ip_alone_takes_the_listeners_port_and_an_address_its_own() {
        let listener: SocketAddr = "0.0.0.0:50061".parse().expect("an address");
        let at = |s: &str| s.parse::<KvAdvertise>().map(|a| a.at(listener).to_string());
        assert_eq!(at("10.1.2.3"), Ok("10.1.2.3:50061".into()));
        assert_eq!(at("fd00::5"), Ok("[fd00::5]:50061".into()));
        assert_eq!(at("10.1.2.3:7000"), Ok("10.1.2.3:7000".into()));
        assert_eq!(at("[fd00::5]:7000"), Ok("[fd00::5]:7000".into()));
        // `$(POD_IP):50061` with an IPv6 pod IP: no address (a port of five digits is no
        // IPv6 group), and said so. (With a port of four digits or fewer it would be another
        // IPv6 address: the pod IP alone is the form to use.)
        let refused = at("fd00::5:50061").expect_err("refused");
        assert!(
            refused.starts_with("\"fd00::5:50061\" is neither"),
            "{refused}"
        );
        assert!(at("decode-0:50061").is_err());
    }
}
