//! End-to-end tests of the `bulkhead` binary: one test binary for the whole package.

mod audit;
mod bench_gateway;
mod device;
mod gateway;
mod netns;
mod otel;
mod policies;
mod scale;
mod transfer_faults;
mod up;
mod upstream;
mod worker_grpc;
mod worker_transport;
