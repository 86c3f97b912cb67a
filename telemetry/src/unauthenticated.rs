//! A budget on the spans of requests refused for their key (HTTP 401): the server span that
//! answered 401 and any span that says `error.type = invalid_api_key` (the gateway's `auth`).
//! Whoever reaches the gateway can send those without a key and without end, and each one's
//! spans went to the exporter's bounded queue, where the spans a full queue cannot take are
//! dropped: a flood of them crowded tenants' spans out. At most [`PER_SECOND`] of them a second
//! are exported (a burst of up to [`BURST`]); the rest are dropped here. The gateway's
//! `/metrics` counts every such request (`bulkhead_gateway_unauthenticated_requests_total`).

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

/// Whether `span` is a server span that answered 401, or says its error was the key. (An
/// unsigned field reaches OpenTelemetry from `tracing` as text: either form is taken.)
fn unauthenticated(span: &SpanData) -> bool {
    span.attributes.iter().any(|kv| match kv.key.as_str() {
        "http.response.status_code" => {
            span.span_kind == SpanKind::Server
                && match &kv.value {
                    Value::I64(status) => *status == 401,
                    Value::String(status) => status.as_str() == "401",
                    _ => false,
                }
        }
        "error.type" => matches!(&kv.value, Value::String(e) if e.as_str() == "invalid_api_key"),
        _ => false,
    })
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

    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::SdkTracerProvider;
    use tracing::field::Empty;
    use tracing_subscriber::layer::SubscriberExt as _;

    use super::*;

    /// Keeps the name of every span it is handed.
    #[derive(Debug, Clone, Default)]
    struct Kept(Arc<Mutex<Vec<String>>>);

    impl SpanProcessor for Kept {
        fn on_start(&self, _: &mut Span, _: &Context) {}
        fn on_end(&self, span: SpanData) {
            self.0.lock().expect("lock").push(span.name.into_owned());
        }
        fn force_flush(&self) -> OTelSdkResult {
            Ok(())
        }
        fn shutdown_with_timeout(&self, _: Duration) -> OTelSdkResult {
            Ok(())
        }
    }

    /// A flood of requests refused for their key, their spans made through `tracing` as the
    /// gateway makes them (the status recorded as a `u16`, which arrives as text, and as an
    /// `i64`; the `auth` span's error), passes a burst, then the rate; every other span
    /// passes: tenants' requests, their `auth` spans, and a client span's 401 (a worker
    /// refusing the gateway's token).
    #[test]
    fn a_flood_of_unauthenticated_requests_exports_a_burst_and_every_other_span() {
        let kept = Kept::default();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(UnauthenticatedBudget::new(kept.clone()))
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, || {
            for _ in 0..1000 {
                tracing::info_span!(
                    "as_u16",
                    otel.kind = "server",
                    http.response.status_code = Empty
                )
                .record("http.response.status_code", 401u16);
                tracing::info_span!(
                    "as_i64",
                    otel.kind = "server",
                    http.response.status_code = Empty
                )
                .record("http.response.status_code", 401i64);
                tracing::info_span!("refused", error.type = Empty)
                    .record("error.type", "invalid_api_key");
                tracing::info_span!(
                    "served",
                    otel.kind = "server",
                    http.response.status_code = Empty
                )
                .record("http.response.status_code", 200u16);
                let _ = tracing::info_span!("authenticated", error.type = Empty);
            }
            tracing::info_span!(
                "client",
                otel.kind = "client",
                http.response.status_code = Empty
            )
            .record("http.response.status_code", 401u16);
        });
        let kept = kept.0.lock().expect("lock").clone();
        let count = |name: &str| kept.iter().filter(|k| *k == name).count();
        assert_eq!(
            (count("served"), count("authenticated"), count("client")),
            (1000, 1000, 1)
        );
        let refused = count("as_u16") + count("as_i64") + count("refused");
        // The burst and what refilled while the test ran (at most 5 s of it); without the
        // budget, 3000.
        assert!(
            (BURST as usize..=BURST as usize + 100).contains(&refused),
            "{refused} of 3000 refused requests' spans"
        );
        assert!(count("as_u16") > 0 && count("as_i64") > 0 && count("refused") > 0);
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
