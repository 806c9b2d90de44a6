//! closbox's predictions: what the fabric model says a collective, or a training step,
//! takes on a topology. Pure (no I/O, no clock): the CLI calls it with the topology and
//! the paths a run got, and renders the answers.
//!
//! - `collective`: the alpha-beta predictor, on the run's ECMP paths or random ones, for
//!   every operation and algorithm the agents run, walking the agents' own schedules
//!   (`closbox_agents::schedule`);
//! - `fluid`: the flow-level simulator for schedules whose ranks do not move in lockstep;
//! - `predict_step`: a data-parallel step, with or without overlap.

pub mod collective;
pub mod fluid;

pub use collective::Predictor;

/// Times in any unit (the same for all).
/// A training step's time from its compute and its buckets' all-reduce times (in
/// backward's order), as the agents run it. Overlap simulation: backward produces buckets one by one; with
/// overlap each is all-reduced as soon as it exists and the link is free.
pub fn predict_step(compute: f64, comm: &[f64], overlap: bool) -> f64 {
    let forward = compute * closbox_agents::schedule::FORWARD_SHARE;
    let per_bucket = (compute - forward) / comm.len().max(1) as f64;
    if !overlap {
        return compute + comm.iter().sum::<f64>();
    }
    let (mut t, mut free) = (forward, forward);
    for c in comm {
        t += per_bucket;
        free = free.max(t) + c;
    }
    t.max(free)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_hides_communication_behind_backward() {
        // 3 ms of compute (1 forward, 2 backward in two buckets of 1 ms), 1 ms per bucket.
        assert!((predict_step(3.0, &[1.0, 1.0], false) - 5.0).abs() < 1e-9);
        // Bucket 0 is ready at 2 ms and done at 3; bucket 1 ready at 3, done at 4.
        assert!((predict_step(3.0, &[1.0, 1.0], true) - 4.0).abs() < 1e-9);
    }
}
