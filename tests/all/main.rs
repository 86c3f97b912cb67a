//! End-to-end tests of the `bulkhead` binary: one test binary for the whole package.

mod audit;
mod gateway;
mod scale;
mod up;
mod worker_grpc;
mod worker_transport;
