//! Agent groups over loopback for tests: a thread per rank, each with its own group.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

use closbox_agents::{Comm, Group, GroupConfig};

/// Listening ports for a group of `n`: below the kernel's ephemeral range (32768–60999),
/// where outgoing connections would collide with them; a block per process.
pub fn ports(n: usize) -> u16 {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let base = 10_000 + (std::process::id() % 20) as u16 * 1000;
    let off = NEXT.fetch_add(n as u16, Ordering::Relaxed);
    assert!(off + (n as u16) < 1000, "test port block exhausted");
    base + off
}

/// Runs `f` on `n` ranks (threads), each with its own group over loopback.
pub fn with_group<T: Send>(
    n: usize,
    channels: usize,
    nodes: Vec<usize>,
    f: impl Fn(&Comm) -> T + Sync,
) -> Vec<T> {
    let base = ports(n);
    let peers: Vec<String> = (0..n)
        .map(|i| format!("127.0.0.1:{}", base + i as u16))
        .collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (peers, nodes, f) = (peers.clone(), nodes.clone(), &f);
                s.spawn(move || {
                    let g = Group::connect(&GroupConfig {
                        rank,
                        peers,
                        channels,
                        timeout: Duration::from_secs(20),
                    })
                    .expect("group forms");
                    f(&Comm::new(&g, nodes))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    })
}
