//! W3C trace context (`traceparent`, `tracestate`) across the hops of a request: from the
//! client's HTTP headers into the gateway's request span, and from a span into the headers of
//! the next hop (gRPC metadata to a worker, decode to prefill, or an OpenAI-compatible
//! upstream's HTTP request). gRPC metadata is an [`http::HeaderMap`] underneath
//! (`MetadataMap::as_ref` / `as_mut`), so one pair of functions serves both.
//!
//! Without the OpenTelemetry layer (export off) both are no-ops: a span has no trace context,
//! so nothing is injected and an incoming one is not adopted.

use http::HeaderMap;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TraceContextExt as _;
use opentelemetry_http::{HeaderExtractor, HeaderInjector};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// Makes `span` the child of the remote span that `headers` name in a valid `traceparent`;
/// without one, `span` keeps its place (a new trace, for a root span). Call it before `span` is
/// first entered.
pub fn continue_trace(span: &Span, headers: &HeaderMap) {
    let cx = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    if cx.span().span_context().is_valid() {
        // Fails only without the OpenTelemetry layer, or once the span started: nothing to do.
        let _ = span.set_parent(cx);
    }
}

/// [`continue_trace`] at the edge, for a trusted client's `traceparent` (a proxy in front that
/// sets it): only a sampled context is continued. A client's unsampled one would take its
/// requests out of every hop's traces (the sampler follows the parent's decision); the request
/// then starts a trace of its own.
pub fn continue_client_trace(span: &Span, headers: &HeaderMap) {
    let cx = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    let remote = cx.span().span_context().clone();
    if remote.is_valid() && remote.is_sampled() {
        let _ = span.set_parent(cx);
    }
}

/// A client's `traceparent` at a public edge: `span` starts a trace of its own, sampled as the
/// gateway samples, and links to the client's span. Read before authentication, a context the
/// client chose could otherwise put its requests' spans — its tenant's id, its model, its
/// errors — into another tenant's trace (one whose id it saw), or decide their sampling.
/// OpenTelemetry's advice for public endpoints: a new trace, the caller's as a link.
pub fn link_client_trace(span: &Span, headers: &HeaderMap) {
    let cx = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    let remote = cx.span().span_context().clone();
    if remote.is_valid() {
        span.add_link(remote);
    }
}

/// Writes `span`'s trace context into `headers`, so that the next hop's spans are its children.
pub fn inject(span: &Span, headers: &mut HeaderMap) {
    TraceContextPropagator::new().inject_context(&span.context(), &mut HeaderInjector(headers));
}

#[cfg(test)]
mod tests {
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::SdkTracerProvider;
    use tracing_subscriber::layer::SubscriberExt as _;

    use super::*;

    const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const PARENT: &str = "00f067aa0ba902b7";

    /// Runs `f` under a subscriber with the OpenTelemetry layer.
    fn traced<T>(f: impl FnOnce() -> T) -> T {
        traced_into(Kept::default(), f)
    }

    /// [`traced`], every span that ends going to `kept`.
    fn traced_into<T>(kept: Kept, f: impl FnOnce() -> T) -> T {
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(kept)
            .build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("test"));
        tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), f)
    }

    fn traceparent(headers: &HeaderMap) -> Option<String> {
        headers
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    }

    #[test]
    fn an_incoming_traceparent_is_continued_and_passed_on_as_a_child() {
        let mut incoming = HeaderMap::new();
        let header = format!("00-{TRACE}-{PARENT}-01");
        incoming.insert("traceparent", header.parse().expect("valid"));
        let out = traced(|| {
            let span = tracing::info_span!("request");
            continue_trace(&span, &incoming);
            let child = tracing::info_span!(parent: &span, "upstream");
            let mut out = HeaderMap::new();
            inject(&child, &mut out);
            out
        });
        let out = traceparent(&out).expect("a traceparent for the next hop");
        let fields: Vec<&str> = out.split('-').collect();
        assert_eq!(fields[0], "00");
        assert_eq!(fields[1], TRACE, "the same trace");
        assert_ne!(fields[2], PARENT, "the next hop's parent is our span");
        assert_eq!(fields[3], "01", "still sampled");
    }

    #[test]
    fn a_clients_unsampled_traceparent_starts_a_trace_of_its_own() {
        let hop = |flags: &str, edge: bool| {
            let mut incoming = HeaderMap::new();
            let header = format!("00-{TRACE}-{PARENT}-{flags}");
            incoming.insert("traceparent", header.parse().expect("a header"));
            let out = traced(|| {
                let span = tracing::info_span!("request");
                if edge {
                    continue_client_trace(&span, &incoming);
                } else {
                    continue_trace(&span, &incoming);
                }
                let mut out = HeaderMap::new();
                inject(&span, &mut out);
                out
            });
            traceparent(&out).expect("a traceparent")
        };
        // Between hops an unsampled context is followed; at the edge it is not.
        assert!(hop("00", false).contains(TRACE));
        let edge = hop("00", true);
        assert!(!edge.contains(TRACE), "{edge}");
        assert!(
            edge.ends_with("-01"),
            "sampled as the gateway samples: {edge}"
        );
        // A sampled one is continued at the edge too.
        assert!(hop("01", true).contains(TRACE));
    }

    /// Keeps every span it is given.
    #[derive(Debug, Clone, Default)]
    struct Kept(std::sync::Arc<std::sync::Mutex<Vec<opentelemetry_sdk::trace::SpanData>>>);

    impl opentelemetry_sdk::trace::SpanExporter for Kept {
        async fn export(
            &self,
            batch: Vec<opentelemetry_sdk::trace::SpanData>,
        ) -> opentelemetry_sdk::error::OTelSdkResult {
            self.0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .extend(batch);
            Ok(())
        }
    }

    /// At a public edge the client's context is a link, never the parent: the request's trace
    /// is the gateway's own, sampled as the gateway samples, whatever the client sent.
    #[test]
    fn a_linked_client_trace_starts_a_trace_of_the_gateways_own() {
        for flags in ["00", "01"] {
            let mut incoming = HeaderMap::new();
            let header = format!("00-{TRACE}-{PARENT}-{flags}");
            incoming.insert("traceparent", header.parse().expect("a header"));
            let kept = Kept::default();
            let out = traced_into(kept.clone(), || {
                let span = tracing::info_span!("request");
                link_client_trace(&span, &incoming);
                let mut out = HeaderMap::new();
                inject(&span, &mut out);
                out
            });
            let out = traceparent(&out).expect("a traceparent");
            assert!(!out.contains(TRACE), "{out}");
            assert!(
                out.ends_with("-01"),
                "sampled as the gateway samples: {out}"
            );
            let spans = kept.0.lock().expect("kept").clone();
            assert_eq!(spans.len(), 1, "{spans:#?}");
            let links: Vec<String> = spans[0]
                .links
                .iter()
                .map(|l| {
                    let c = &l.span_context;
                    format!("{}-{}", c.trace_id(), c.span_id())
                })
                .collect();
            assert_eq!(links, [format!("{TRACE}-{PARENT}")]);
        }
    }

    #[test]
    fn without_a_valid_traceparent_a_new_trace_starts() {
        let mut incoming = HeaderMap::new();
        incoming.insert("traceparent", "00-zz-yy-01".parse().expect("a header"));
        let out = traced(|| {
            let span = tracing::info_span!("request");
            continue_trace(&span, &incoming);
            let mut out = HeaderMap::new();
            inject(&span, &mut out);
            out
        });
        let out = traceparent(&out).expect("a traceparent");
        assert!(!out.contains(TRACE));
        assert_eq!(out.len(), 55, "{out}");
    }

    #[test]
    fn without_the_opentelemetry_layer_nothing_is_injected() {
        let span = tracing::info_span!("request");
        let mut out = HeaderMap::new();
        inject(&span, &mut out);
        assert!(out.is_empty(), "{out:?}");
    }
}
