//! closbox's fabric model: topology files, generators, routing, and a deterministic,
//! sans-IO packet-level model of switches, queues and links.
//!
//! Nothing in this crate does I/O or reads a clock: time and packets come in, scheduled
//! deliveries and the next deadline go out. The daemon (`switchd`) drives it in real time;
//! tests drive it with a virtual clock.

pub mod config;
mod fq;
pub mod frame;
pub mod generate;
pub mod load;
pub mod names;
pub mod topology;
pub mod units;

pub use config::{load, parse, ConfigError};
pub use frame::Frame;
pub use topology::Topology;
pub use units::{Bandwidth, Bytes, Duration, Instant, TimeScale};
pub mod model;
pub mod packet;
pub mod plan;
pub mod reassembly;
pub mod rng;
pub mod routing;

pub use model::{Delivery, DropReason, Fabric, Verdict};
pub use topology::HostId;
