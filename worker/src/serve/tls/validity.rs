//! When a serving certificate may be used: its expiry on `/metrics`, and a warning when a
//! certificate is loaded that is not valid now or lapses soon. Peers refuse a lapsed
//! certificate in the handshake, so a renewal that never came shows up as every connection
//! failing at once; the gauge lets an operator alert days before.

use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use x509_parser::certificate::X509Certificate;
use x509_parser::time::ASN1Time;

/// How long before its end a certificate being loaded is warned of.
pub const RENEW_WITHIN: Duration = Duration::from_secs(14 * 24 * 3600);

/// The validity period of a certificate, in whole seconds since the Unix epoch (X.509 states
/// it to the second).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Validity {
    /// Its `notBefore`.
    pub not_before: i64,
    /// Its `notAfter`: the last second it is valid.
    pub not_after: i64,
}

/// What is wrong with using a certificate at some moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Concern {
    /// Its period has not begun.
    NotYetValid { not_before: i64 },
    /// Its period has ended.
    Lapsed { not_after: i64 },
    /// It ends within [`RENEW_WITHIN`].
    LapsesSoon { not_after: i64, left: Duration },
}

impl Validity {
    /// The validity period of `cert`.
    pub fn of(cert: &X509Certificate<'_>) -> Validity {
        let period = cert.validity();
        Validity {
            not_before: period.not_before.timestamp(),
            not_after: period.not_after.timestamp(),
        }
    }

    /// What is wrong with using it at `now`, if anything.
    pub fn concern(&self, now: SystemTime) -> Option<Concern> {
        let now = match now.duration_since(UNIX_EPOCH) {
            Ok(since) => i64::try_from(since.as_secs()).unwrap_or(i64::MAX),
            Err(_) => 0,
        };
        if now < self.not_before {
            return Some(Concern::NotYetValid {
                not_before: self.not_before,
            });
        }
        if now > self.not_after {
            return Some(Concern::Lapsed {
                not_after: self.not_after,
            });
        }
        let left = Duration::from_secs(u64::try_from(self.not_after - now).unwrap_or(0));
        (left < RENEW_WITHIN).then_some(Concern::LapsesSoon {
            not_after: self.not_after,
            left,
        })
    }
}

/// A moment as X.509 tools print it (e.g. `Dec  5 04:15:34 2026 +00:00`).
fn moment(seconds: i64) -> String {
    ASN1Time::from_timestamp(seconds).map_or_else(|_| format!("{seconds} s"), |t| t.to_string())
}

impl std::fmt::Display for Concern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Concern::NotYetValid { not_before } => write!(
                f,
                "is not valid before {} (is this host's clock behind?): peers refuse it until then",
                moment(not_before)
            ),
            Concern::Lapsed { not_after } => write!(
                f,
                "lapsed at {}: peers refuse it; renew it",
                moment(not_after)
            ),
            Concern::LapsesSoon { not_after, left } => write!(
                f,
                "lapses at {}, in {} h: renew it before then",
                moment(not_after),
                left.as_secs() / 3600
            ),
        }
    }
}

/// Prometheus text: when each certificate in use lapses, by the name of its use (`listen`:
/// the gateway's own ports; `cluster`: the deployment's mutual TLS). Nothing without any.
pub fn render_expiry(out: &mut String, certificates: &[(&str, Validity)]) {
    if certificates.is_empty() {
        return;
    }
    let name = "bulkhead_tls_certificate_expiry_timestamp_seconds";
    let _ = writeln!(
        out,
        "# HELP {name} When the certificate this process presents lapses (its notAfter), in \
         seconds since the Unix epoch; alert on it minus time(). Follows renewals.\n\
         # TYPE {name} gauge"
    );
    for (certificate, validity) in certificates {
        let _ = writeln!(
            out,
            "{name}{{certificate=\"{certificate}\"}} {}",
            validity.not_after
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: u64 = 24 * 3600;

    fn at(seconds: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(seconds)
    }

    #[test]
    fn a_certificate_is_read_for_its_period() {
        let mut params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        params.not_before = rcgen::date_time_ymd(2026, 1, 2);
        params.not_after = rcgen::date_time_ymd(2027, 3, 4);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        let (_, parsed) = x509_parser::parse_x509_certificate(cert.der()).unwrap();
        let validity = Validity::of(&parsed);
        // 2026-01-02 and 2027-03-04, 00:00 UTC.
        assert_eq!(
            validity,
            Validity {
                not_before: 1_767_312_000,
                not_after: 1_804_118_400
            }
        );
    }

    #[test]
    fn concerns_are_told_by_the_moment() {
        let v = Validity {
            not_before: 1_000 * DAY as i64,
            not_after: 1_100 * DAY as i64,
        };
        assert_eq!(v.concern(at(1_050 * DAY)), None);
        assert_eq!(
            v.concern(at(999 * DAY)),
            Some(Concern::NotYetValid {
                not_before: 1_000 * DAY as i64
            })
        );
        assert_eq!(
            v.concern(at(1_100 * DAY + 1)),
            Some(Concern::Lapsed {
                not_after: 1_100 * DAY as i64
            })
        );
        // The last day of the window is a concern; one second more left is not.
        assert_eq!(
            v.concern(at(1_086 * DAY + 1)),
            Some(Concern::LapsesSoon {
                not_after: 1_100 * DAY as i64,
                left: RENEW_WITHIN - Duration::from_secs(1)
            })
        );
        assert_eq!(v.concern(at(1_086 * DAY)), None);
        let soon = v.concern(at(1_099 * DAY)).unwrap().to_string();
        assert!(soon.contains("in 24 h"), "{soon}");
        assert!(soon.contains("1973"), "{soon}");
    }

    #[test]
    fn the_gauge_names_each_certificate_by_its_use() {
        let mut out = String::new();
        render_expiry(&mut out, &[]);
        assert_eq!(out, "");
        let v = |not_after| Validity {
            not_before: 0,
            not_after,
        };
        render_expiry(
            &mut out,
            &[("listen", v(1_800_000_000)), ("cluster", v(42))],
        );
        assert!(out.contains("# TYPE bulkhead_tls_certificate_expiry_timestamp_seconds gauge\n"));
        assert!(out.contains(
            "bulkhead_tls_certificate_expiry_timestamp_seconds{certificate=\"listen\"} 1800000000\n"
        ));
        assert!(out.contains(
            "bulkhead_tls_certificate_expiry_timestamp_seconds{certificate=\"cluster\"} 42\n"
        ));
    }
}
