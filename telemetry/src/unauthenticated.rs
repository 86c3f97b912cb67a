//! A budget on the spans of requests refused for their key (HTTP 401). Whoever reaches the
//! gateway can send those without a key and without end, and each one's span went to the
//! exporter's bounded queue, where the spans a full queue cannot take are dropped: a flood of
//! them crowded tenants' spans out. At most [`PER_SECOND`] of them a second are exported (a
//! burst of up to [`BURST`]); the rest are dropped here. The gateway's `/metrics` counts every
//! one (`bulkhead_gateway_unauthenticated_requests_total`).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use opentelemetry::trace::SpanKind;
use opentelemetry::{Context, Value};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Span, SpanData, SpanProcessor};

/// Spans of unauthenticated requests exported a second, at most, over time.
pub const PER_SECOND: f64 = 20.0;

/// Spans of unauthenticated requests exported at once, at most, after a quiet while.
pub const BURST: f64 = 100.0;

/// `next`, with the spans of requests refused for their key held to the budget.
#[derive(Debug)]
pub struct UnauthenticatedBudget<P> {
    next: P,
    bucket: Mutex<Bucket>,
}

/// A token bucket: `tokens` of [`BURST`] at `at`.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    /// Takes a token, if one is there at `now`.
    fn take(&mut self, now: Instant) -> bool {
        let refilled = now.saturating_duration_since(self.at).as_secs_f64() * PER_SECOND;
        self.tokens = (self.tokens + refilled).min(BURST);
        self.at = now;
        let taken = self.tokens >= 1.0;
        if taken {
            self.tokens -= 1.0;
        }
        taken
    }
}

impl<P> UnauthenticatedBudget<P> {
    pub fn new(next: P) -> UnauthenticatedBudget<P> {
        UnauthenticatedBudget {
            next,
            bucket: Mutex::new(Bucket {
                tokens: BURST,
                at: Instant::now(),
            }),
        }
    }
}

/// Whether `span` is a server span that answered 401.
fn unauthenticated(span: &SpanData) -> bool {
    span.span_kind == SpanKind::Server
        && span
            .attributes
            .iter()
            .any(|kv| kv.key.as_str() == "http.response.status_code" && kv.value == Value::I64(401))
}

impl<P: SpanProcessor> SpanProcessor for UnauthenticatedBudget<P> {
    fn on_start(&self, span: &mut Span, cx: &Context) {
        self.next.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if unauthenticated(&span) {
            let mut bucket = self
                .bucket
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if !bucket.take(Instant::now()) {
                return;
            }
        }
        self.next.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.next.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.next.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.next.set_resource(resource);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use opentelemetry::KeyValue;
    use opentelemetry::trace::{Span as _, Tracer as _, TracerProvider as _};
    use opentelemetry_sdk::trace::SdkTracerProvider;

    use super::*;

    /// Keeps the status of every span it is handed.
    #[derive(Debug, Clone, Default)]
    struct Kept(Arc<Mutex<Vec<i64>>>);

    impl SpanProcessor for Kept {
        fn on_start(&self, _: &mut Span, _: &Context) {}
        fn on_end(&self, span: SpanData) {
            let status = span.attributes.iter().find_map(|kv| match kv.value {
                Value::I64(s) if kv.key.as_str() == "http.response.status_code" => Some(s),
                _ => None,
            });
            self.0.lock().expect("lock").push(status.unwrap_or(0));
        }
        fn force_flush(&self) -> OTelSdkResult {
            Ok(())
        }
        fn shutdown_with_timeout(&self, _: Duration) -> OTelSdkResult {
            Ok(())
        }
    }

    /// A flood of 401s passes a burst, then the rate; every other span passes, the tenants'
    /// requests and a client span's 401 (a worker refusing the gateway's token) alike.
    #[test]
    fn a_flood_of_unauthenticated_requests_exports_a_burst_and_every_other_span() {
        let kept = Kept::default();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(UnauthenticatedBudget::new(kept.clone()))
            .build();
        let tracer = provider.tracer("test");
        let end = |status: i64, kind: SpanKind| {
            let mut span = tracer
                .span_builder("request")
                .with_kind(kind)
                .start(&tracer);
            span.set_attribute(KeyValue::new("http.response.status_code", status));
            span.end();
        };
        for _ in 0..1000 {
            end(401, SpanKind::Server);
            end(200, SpanKind::Server);
        }
        end(401, SpanKind::Client);
        let kept = kept.0.lock().expect("lock").clone();
        let count = |s: i64| kept.iter().filter(|&&k| k == s).count();
        assert_eq!(count(200), 1000);
        let refused = count(401);
        assert!(
            // The burst, what refilled while the test ran (at most 5 s of it) and the
            // client span; without the budget, 1001.
            (BURST as usize + 1..=BURST as usize + 101).contains(&refused),
            "{refused} of 1000 (and the client span)"
        );
    }

    #[test]
    fn the_budget_refills_at_its_rate_up_to_its_burst() {
        let t0 = Instant::now();
        let mut b = Bucket {
            tokens: 0.0,
            at: t0,
        };
        assert!(!b.take(t0));
        assert!(b.take(t0 + Duration::from_millis(60)), "1.2 tokens by then");
        assert!(!b.take(t0 + Duration::from_millis(60)));
        let later = t0 + Duration::from_secs(3600);
        assert!((0..BURST as usize).all(|_| b.take(later)));
        assert!(!b.take(later), "no more than the burst");
    }
}
