//! The process's tracing subscriber: the stderr log, and — when an OTLP endpoint is
//! configured — the OpenTelemetry layer and the audit log records' exporter.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{LogExporter, Protocol, SpanExporter, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::logs::SdkLoggerProvider;
use opentelemetry_sdk::trace::{BatchSpanProcessor, SdkTracerProvider};
use tracing::{Level, Metadata};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::Layer as _;
use tracing_subscriber::filter::filter_fn;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

use crate::audit::AuditExport;
use crate::unauthenticated::UnauthenticatedBudget;

/// How long shutdown waits for the last spans and records to be exported.
const SHUTDOWN_LIMIT: Duration = Duration::from_secs(3);

/// Why telemetry could not start.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error(
        "OTLP endpoint {endpoint:?}: {reason} (expected a collector's base URL like http://127.0.0.1:4318)"
    )]
    Endpoint { endpoint: String, reason: String },
    #[error("the OTLP exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
    #[error("a tracing subscriber is already installed: {0}")]
    Subscriber(#[from] tracing_subscriber::util::TryInitError),
}

/// A collector's base URL, as `OTEL_EXPORTER_OTLP_ENDPOINT` has it: spans go to
/// `{endpoint}/v1/traces`, log records to `{endpoint}/v1/logs` (OTLP over HTTP/protobuf).
/// Plain `http` only: no TLS stack is built in (put a collector or sidecar next to the process).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtlpEndpoint(String);

impl OtlpEndpoint {
    /// The URL spans are posted to.
    pub fn traces(&self) -> String {
        format!("{}/v1/traces", self.0)
    }

    /// The URL log records are posted to.
    pub fn logs(&self) -> String {
        format!("{}/v1/logs", self.0)
    }
}

impl FromStr for OtlpEndpoint {
    type Err = TelemetryError;

    fn from_str(s: &str) -> Result<OtlpEndpoint, TelemetryError> {
        let refuse = |reason: &str| TelemetryError::Endpoint {
            endpoint: crate::redacted_url(s),
            reason: reason.to_owned(),
        };
        let uri: http::Uri = s
            .parse()
            .map_err(|e: http::uri::InvalidUri| refuse(&e.to_string()))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => return Err(refuse("https is not built in; use http")),
            _ => return Err(refuse("the URL needs the http:// scheme")),
        }
        let Some(authority) = uri.authority() else {
            return Err(refuse("no host"));
        };
        if authority.as_str().contains('@') {
            return Err(refuse(
                "credentials in the URL are not supported (and would be logged)",
            ));
        }
        if uri.query().is_some() {
            return Err(refuse("a query string is not allowed"));
        }
        Ok(OtlpEndpoint(s.trim_end_matches('/').to_owned()))
    }
}

impl fmt::Display for OtlpEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What to export, when export is on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Otlp {
    pub endpoint: OtlpEndpoint,
    /// Also export each final audit record as a log record (the gateway).
    pub audit_logs: bool,
}

/// What [`Telemetry::install`] sets up.
#[derive(Debug)]
pub struct Settings {
    /// `service.name` of every span and record: `bulkhead-gateway`, `bulkhead-worker`.
    pub service_name: &'static str,
    /// More resource attributes (a worker's role).
    pub resource: Vec<KeyValue>,
    /// Which events and spans the stderr log shows (`BULKHEAD_LOG`).
    pub log_filter: EnvFilter,
    /// `None`: nothing is exported (the default).
    pub otlp: Option<Otlp>,
}

/// The installed telemetry. Dropping it exports what is still queued (bounded by a few
/// seconds) and stops the exporters.
#[derive(Debug)]
pub struct Telemetry {
    tracer: Option<SdkTracerProvider>,
    logger: Option<SdkLoggerProvider>,
}

/// Spans of our own crates go to the collector; events stay in the stderr log (their messages
/// may quote errors, and exporting them would duplicate the log).
fn exported(meta: &Metadata<'_>) -> bool {
    meta.is_span() && meta.target().starts_with("bulkhead") && *meta.level() <= Level::INFO
}

impl Telemetry {
    /// Installs the process's global tracing subscriber. With `otlp`, spans are exported to
    /// the collector in batches by a thread of the SDK's own; a collector that is slow or down
    /// never delays a request (a full queue drops spans).
    pub fn install(settings: Settings) -> Result<Telemetry, TelemetryError> {
        let log = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_filter(settings.log_filter);
        let Some(otlp) = settings.otlp else {
            tracing_subscriber::registry().with(log).try_init()?;
            return Ok(Telemetry {
                tracer: None,
                logger: None,
            });
        };
        let resource = Resource::builder()
            .with_service_name(settings.service_name)
            .with_attributes(settings.resource)
            .build();
        let spans = SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(otlp.endpoint.traces())
            .build()?;
        let tracer = SdkTracerProvider::builder()
            .with_span_processor(UnauthenticatedBudget::new(
                BatchSpanProcessor::builder(spans).build(),
            ))
            .with_resource(resource.clone())
            .build();
        let logger = if otlp.audit_logs {
            let records = LogExporter::builder()
                .with_http()
                .with_protocol(Protocol::HttpBinary)
                .with_endpoint(otlp.endpoint.logs())
                .build()?;
            Some(
                SdkLoggerProvider::builder()
                    .with_batch_exporter(records)
                    .with_resource(resource)
                    .build(),
            )
        } else {
            None
        };
        let layer = tracing_opentelemetry::layer()
            .with_tracer(tracer.tracer("bulkhead"))
            .with_location(false)
            .with_threads(false)
            .with_target(false)
            .with_level(false)
            .with_tracked_inactivity(false)
            .with_filter(filter_fn(exported));
        tracing_subscriber::registry()
            .with(log)
            .with(layer)
            .try_init()?;
        Ok(Telemetry {
            tracer: Some(tracer),
            logger,
        })
    }

    /// The exporter of audit records, when audit log export is on.
    pub fn audit_export(&self) -> Option<AuditExport> {
        self.logger.as_ref().map(AuditExport::new)
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        let (tracer, logger) = (self.tracer.take(), self.logger.take());
        // Both at once: a collector that never answers costs the shutdown one limit, not two.
        std::thread::scope(|scope| {
            scope.spawn(|| {
                if let Some(tracer) = tracer
                    && let Err(e) = tracer.shutdown_with_timeout(SHUTDOWN_LIMIT)
                {
                    tracing::warn!(error = %e, "the last spans could not be exported");
                }
            });
            if let Some(logger) = logger
                && let Err(e) = logger.shutdown_with_timeout(SHUTDOWN_LIMIT)
            {
                tracing::warn!(error = %e, "the last audit log records could not be exported");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_base_urls_with_the_signal_paths_appended() {
        let e: OtlpEndpoint = "http://127.0.0.1:4318/".parse().expect("valid");
        assert_eq!(e.traces(), "http://127.0.0.1:4318/v1/traces");
        assert_eq!(e.logs(), "http://127.0.0.1:4318/v1/logs");
        let e: OtlpEndpoint = "http://collector.obs:4318/otlp".parse().expect("valid");
        assert_eq!(e.traces(), "http://collector.obs:4318/otlp/v1/traces");
    }

    #[test]
    fn endpoints_without_plain_http_are_refused_with_the_reason() {
        for (bad, reason) in [
            ("https://collector:4318", "https is not built in"),
            ("collector:4318", "http:// scheme"),
            ("/v1/traces", "http:// scheme"),
            ("http://collector:4318/?a=b", "query"),
            ("http://exa mple", "invalid"),
            ("http://u:sk-secret@collector:4318", "credentials"),
            ("http://collector:4318/?api_key=sk-secret", "query"),
            ("http://u:sk-secret@collector:4318/ x", "invalid"),
        ] {
            let e = bad.parse::<OtlpEndpoint>().expect_err(bad).to_string();
            assert!(e.contains(reason), "{bad}: {e}");
            assert!(!e.contains("sk-secret"), "{bad}: {e}");
        }
    }
}
