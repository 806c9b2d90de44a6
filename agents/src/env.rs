//! The agent's view of its job, from the environment `closbox run` sets.

use std::time::Duration;

use anyhow::{bail, Context};
use closbox_fabric::TimeScale;

use crate::comm::GroupConfig;

/// Port agents listen on (each GPU has its own address, so one port serves all).
pub const DEFAULT_PORT: u16 = 29600;

#[derive(Clone, Debug)]
pub struct JobEnv {
    pub group: GroupConfig,
    /// Node of each rank (CLOSBOX_NODES), for hierarchical algorithms.
    pub nodes: Vec<usize>,
    /// Fabric time runs this many times slower than wall time.
    pub time_scale: TimeScale,
}

fn var(name: &str) -> anyhow::Result<String> {
    std::env::var(name).with_context(|| {
        format!("{name} is not set: run the agent with `closbox run` (or set RANK, CLOSBOX_PEERS)")
    })
}

impl JobEnv {
    /// Reads RANK, CLOSBOX_PEERS (host or host:port per rank, comma-separated),
    /// CLOSBOX_NODES and CLOSBOX_TIME_SCALE.
    pub fn from_env(channels: usize, port: u16, timeout: Duration) -> anyhow::Result<JobEnv> {
        let rank: usize = var("RANK")?.parse().context("RANK")?;
        let peers: Vec<String> = var("CLOSBOX_PEERS")?
            .split(',')
            .map(|p| {
                if p.contains(':') {
                    p.to_owned()
                } else {
                    format!("{p}:{port}")
                }
            })
            .collect();
        if let Ok(w) = std::env::var("WORLD_SIZE") {
            if w.parse::<usize>().ok() != Some(peers.len()) {
                bail!(
                    "WORLD_SIZE={w} but CLOSBOX_PEERS names {} ranks",
                    peers.len()
                );
            }
        }
        let nodes = match std::env::var("CLOSBOX_NODES") {
            Ok(s) => s
                .split(',')
                .map(|n| n.parse().context("CLOSBOX_NODES"))
                .collect::<anyhow::Result<_>>()?,
            Err(_) => (0..peers.len()).collect(),
        };
        let time_scale = match std::env::var("CLOSBOX_TIME_SCALE") {
            Ok(t) => t.parse().ok().and_then(TimeScale::new).with_context(|| {
                format!("CLOSBOX_TIME_SCALE={t:?} is not a time scale (1 to 10⁶)")
            })?,
            Err(_) => TimeScale::REAL_TIME,
        };
        Ok(JobEnv {
            group: GroupConfig {
                rank,
                peers,
                channels,
                timeout,
            },
            nodes,
            time_scale,
        })
    }
}
