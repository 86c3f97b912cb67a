//! End-to-end tests of the `bulkhead` binary: one test binary for the whole package.

mod audit;
mod bench_engine;
mod bench_gateway;
mod bench_policies;
mod bench_prefix;
mod cluster;
mod device;
mod gateway;
mod generate;
mod isolation;
mod isolation_load;
// Scenarios that turn checks off: test builds only (`--features check-switches`).
#[cfg(feature = "check-switches")]
mod isolation_switches;
mod netns;
mod oracles;
mod otel;
mod policies;
mod scale;
mod template_sandbox;
mod transfer_faults;
mod up;
mod upstream;
mod worker_grpc;
mod worker_transport;
