//! Logs and OpenTelemetry for every command: `BULKHEAD_LOG` filters the stderr log; the
//! servers (`worker`, `gateway`, `up`) also export spans — and the gateway its audit records —
//! over OTLP when an endpoint is given (`--otlp-endpoint`, the standard
//! `OTEL_EXPORTER_OTLP_ENDPOINT`, or the gateway configuration's `[telemetry]`).

use anyhow::Context;
use bulkhead_telemetry::{KeyValue, Otlp, OtlpEndpoint, Settings, Telemetry};

/// Environment variables.
pub mod env {
    /// The stderr log's filter (tracing env-filter syntax).
    pub const LOG: &str = "BULKHEAD_LOG";
    /// The collector's base URL (OpenTelemetry's standard variable).
    pub const OTLP_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
}

/// The process kinds, by the `service.name` their telemetry carries.
#[derive(Debug, Clone, Copy)]
pub enum Service {
    Gateway,
    /// A worker, with its role (`both`, `prefill`, `decode`).
    Worker(&'static str),
}

/// `--otlp-endpoint`, shared by the servers.
#[derive(Debug, Clone, clap::Args)]
pub struct OtlpArgs {
    /// Export spans over OTLP (HTTP/protobuf) to this collector: its base URL, e.g.
    /// http://127.0.0.1:4318 (spans go to /v1/traces, audit records to /v1/logs). Off when
    /// unset (a gateway configuration's [telemetry] otlp_endpoint applies then).
    #[arg(long, env = env::OTLP_ENDPOINT, value_name = "URL")]
    pub otlp_endpoint: Option<OtlpEndpoint>,
}

/// The stderr log's filter: `spec` (`BULKHEAD_LOG`, or the default level) with rustls held
/// to errors unless `spec` names it. rustls logs what a peer sends it — alerts, a refused
/// renegotiation — as warnings, so anyone who can open a connection to a TLS port could fill
/// the log; the gateway counts its handshakes on `/metrics` and logs a failed one at debug.
fn log_directives(spec: &str) -> String {
    // A directive's target is what comes before its span filter and its level.
    let names_rustls = spec.split(',').any(|directive| {
        let target = directive
            .split(['[', '='])
            .next()
            .unwrap_or_default()
            .trim();
        target == "rustls" || target.starts_with("rustls::")
    });
    if names_rustls {
        spec.to_owned()
    } else {
        format!("{spec},rustls=error")
    }
}

/// Installs the stderr log (`BULKHEAD_LOG`, else `default_level`) and, with `export`, the
/// export of that service's telemetry.
pub fn install(default_level: &str, export: Option<(Service, Otlp)>) -> anyhow::Result<Telemetry> {
    let spec = std::env::var(env::LOG).unwrap_or_else(|_| default_level.to_owned());
    let log_filter = tracing_subscriber::EnvFilter::try_new(log_directives(&spec))
        .unwrap_or_else(|_| log_directives(default_level).into());
    let (service_name, resource, otlp) = match export {
        None => ("bulkhead", Vec::new(), None),
        Some((Service::Gateway, otlp)) => ("bulkhead-gateway", Vec::new(), Some(otlp)),
        Some((Service::Worker(role), otlp)) => (
            "bulkhead-worker",
            vec![KeyValue::new(bulkhead_telemetry::WORKER_ROLE, role)],
            Some(otlp),
        ),
    };
    let endpoint = otlp.as_ref().map(|o| o.endpoint.to_string());
    let telemetry = Telemetry::install(Settings {
        service_name,
        resource,
        log_filter,
        otlp,
    })
    .context("starting telemetry")?;
    // Test builds: the switches are turned on once the log exists to say so loudly.
    crate::switches::install()?;
    if let Some(endpoint) = endpoint {
        tracing::info!(%endpoint, service_name, "exporting spans over OTLP");
    }
    Ok(telemetry)
}

/// The gateway's export: `--otlp-endpoint` (or `OTEL_EXPORTER_OTLP_ENDPOINT`) over the
/// configuration's `[telemetry] otlp_endpoint`; audit records too when the configuration says.
pub fn gateway_export(
    args: &OtlpArgs,
    config: &bulkhead_gateway::config::TelemetrySettings,
) -> anyhow::Result<Option<Otlp>> {
    let endpoint = args
        .otlp_endpoint
        .clone()
        .or_else(|| config.otlp_endpoint.clone());
    match endpoint {
        Some(endpoint) => Ok(Some(Otlp {
            endpoint,
            audit_logs: config.audit_logs,
        })),
        None if config.audit_logs => anyhow::bail!(
            "telemetry.audit_logs needs a collector: set telemetry.otlp_endpoint, \
             --otlp-endpoint or {}",
            env::OTLP_ENDPOINT
        ),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::log_directives;

    #[test]
    fn rustls_is_held_to_errors_unless_the_filter_names_it() {
        assert_eq!(log_directives("warn"), "warn,rustls=error");
        assert_eq!(
            log_directives("info,bulkhead_gateway=debug"),
            "info,bulkhead_gateway=debug,rustls=error"
        );
        assert_eq!(log_directives("debug,rustls=debug"), "debug,rustls=debug");
        assert_eq!(
            log_directives("rustls::common_state=warn"),
            "rustls::common_state=warn"
        );
        // Another crate whose name holds it is not rustls.
        assert_eq!(
            log_directives("tokio_rustls=debug"),
            "tokio_rustls=debug,rustls=error"
        );
    }
}
