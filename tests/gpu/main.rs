//! The tests that need a GPU (`cargo test --features gpu --test gpu`): one binary, a module per
//! area, each checking data read back from the device. `scripts/gpu-suite.sh` runs it natively,
//! with each memory resource, and through the TCC interposer.

mod api;
mod devices;
mod graph;
#[path = "../graph_cases/mod.rs"]
mod graph_cases;
mod launch;
mod memory;
mod multi;
