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
