//! End-to-end tests of the `bulkhead` binary: one test binary for the whole package.

mod device;
mod gateway;
mod worker_grpc;
mod worker_transport;
