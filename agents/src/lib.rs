//! closbox's GPU agents: collectives over TCP on real data, an nccl-tests-style benchmark
//! and a data-parallel training-step workload. One agent per GPU; they need no root and
//! run over loopback as well as through a closbox fabric.

pub mod bench;
pub mod coll;
pub mod comm;
pub mod dtype;
pub mod env;
pub mod schedule;
pub mod train;

pub use coll::{Algo, Comm, Op};
pub use comm::{Endpoint, Endpoints, Group, GroupConfig};
pub use dtype::{DType, ReduceOp};

/// What an agent prints on stdout, one JSON line each, tagged by `"line"`:
/// `{"line":"endpoints",…}` (every rank, once its group forms), `{"line":"row",…}`
/// (rank 0, a benchmark result), `{"line":"report",…}` (rank 0, a training mode).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "line", rename_all = "lowercase")]
pub enum Output {
    Endpoints(Endpoints),
    Row(bench::Row),
    Report(train::Report),
}

impl Output {
    /// The line to print.
    pub fn to_line(&self) -> String {
        serde_json::to_string(self).expect("agent output serializes")
    }

    /// A line an agent printed, if it is one of these (other lines are the program's
    /// own messages).
    pub fn parse(line: &str) -> Option<Output> {
        serde_json::from_str(line).ok()
    }
}
