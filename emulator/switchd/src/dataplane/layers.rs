//! Who holds each changed link as it is: the timelines (scenarios; 0: by hand) that took
//! it down, and the values each one's degrade set, so that one fault's repair undoes only
//! that fault. Two scenarios that degrade one link, or a flap of a link whose spine is
//! down, would otherwise undo each other: the first repair reset the link for both.
//!
//! A link is down while any timeline holds it down; its values are, field by field and
//! direction by direction, the latest degrade still in place over its own values (those
//! set by hand, else the topology's). By hand is the operator's word: a set by hand
//! changes the link's own values and takes the fields it sets from every degrade (it
//! shows at once, and a later repair does not bring an older degrade of them back); an
//! up or reset by hand ends every timeline's hold on the link.
//!
//! A GPU's host holds its links down while its interface is down (`links`): nobody else
//! can bring them up, neither the hand nor a scenario nor `closbox reset`, since the
//! fabric's side cannot make a NIC that its host set down carry frames.

use std::collections::{BTreeSet, HashMap};

use closbox_fabric::model::Change;
use closbox_fabric::topology::LinkParams;
use closbox_fabric::{Bandwidth, Bytes, Duration};

/// One direction's values: the link's, and the egress buffer at its sending end.
pub(super) type Values = (LinkParams, Bytes);

/// Who holds a link as it is: a fault of a timeline. Changes of one holder undo each other
/// (a down and its up, a set and its reset): fault 0 is a timeline's own steps, other
/// faults are those that repair themselves (a flap, a scenario's random fault), so that
/// two of one scenario overlapping on a link are undone one by one too.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) struct Holder {
    /// The scenario's timeline; 0: by hand.
    pub(super) timeline: u64,
    pub(super) fault: u32,
}

impl From<u64> for Holder {
    fn from(timeline: u64) -> Holder {
        Holder { timeline, fault: 0 }
    }
}

/// By hand (not a scenario's timeline, nor a flap).
const HAND: Holder = Holder {
    timeline: 0,
    fault: 0,
};

/// The timeline that stands for the GPUs' hosts: a GPU's holds its links down while its
/// interface is down (its fault: the GPU's index). Never a scenario's number.
pub const HOST: u64 = u64::MAX;

impl Holder {
    /// GPU `gpu`'s host.
    pub(super) fn host(gpu: usize) -> Holder {
        Holder {
            timeline: HOST,
            fault: gpu as u32,
        }
    }

    fn is_host(self) -> bool {
        self.timeline == HOST
    }

    /// A timeline's that no longer runs (see `Layers::live`); never the hand's or a host's.
    fn ended(self, live: &BTreeSet<u64>) -> bool {
        self.timeline != 0 && !self.is_host() && !live.contains(&self.timeline)
    }
}

/// One field's values set by degrades, the latest last; one per holder.
#[derive(Clone, Debug)]
struct Stack<T>(Vec<(Holder, T)>);

impl<T> Default for Stack<T> {
    fn default() -> Self {
        Stack(Vec::new())
    }
}

impl<T: Copy> Stack<T> {
    fn set(&mut self, t: Holder, v: T) {
        self.release(t);
        self.0.push((t, v));
    }

    fn release(&mut self, t: Holder) {
        self.0.retain(|&(u, _)| u != t);
    }

    /// Lets go of the values of the holders `gone` says.
    fn release_if(&mut self, gone: impl Fn(Holder) -> bool) {
        self.0.retain(|&(u, _)| !gone(u));
    }

    /// Keeps, of the values of ended timelines, the latest only: the others are under it
    /// and go with it (whoever releases one releases all).
    fn compact(&mut self, ended: impl Fn(Holder) -> bool) {
        let Some(top) = self.0.iter().rposition(|&(u, _)| ended(u)) else {
            return;
        };
        let mut i = 0;
        self.0.retain(|&(u, _)| {
            i += 1;
            i - 1 == top || !ended(u)
        });
    }

    /// `base` under the latest degrade of the field.
    fn over(&self, base: T) -> T {
        self.0.last().map_or(base, |&(_, v)| v)
    }

    fn timelines(&self) -> impl Iterator<Item = u64> + '_ {
        self.0.iter().map(|&(t, _)| t.timeline)
    }
}

/// Timelines' degrades of one direction of a link.
#[derive(Clone, Debug, Default)]
struct Degrades {
    rate: Stack<Bandwidth>,
    delay: Stack<Duration>,
    loss: Stack<f64>,
    loss_burst: Stack<f64>,
    buffer: Stack<Bytes>,
}

impl Degrades {
    fn release_if(&mut self, gone: impl Fn(Holder) -> bool + Copy) {
        self.rate.release_if(gone);
        self.delay.release_if(gone);
        self.loss.release_if(gone);
        self.loss_burst.release_if(gone);
        self.buffer.release_if(gone);
    }

    fn compact(&mut self, ended: impl Fn(Holder) -> bool + Copy) {
        self.rate.compact(ended);
        self.delay.compact(ended);
        self.loss.compact(ended);
        self.loss_burst.compact(ended);
        self.buffer.compact(ended);
    }

    fn timelines(&self, into: &mut BTreeSet<u64>) {
        into.extend(self.rate.timelines());
        into.extend(self.delay.timelines());
        into.extend(self.loss.timelines());
        into.extend(self.loss_burst.timelines());
        into.extend(self.buffer.timelines());
    }

    fn over(&self, (link, buffer): Values) -> Values {
        (
            LinkParams {
                rate: self.rate.over(link.rate),
                delay: self.delay.over(link.delay),
                loss: self.loss.over(link.loss),
                loss_burst: self.loss_burst.over(link.loss_burst),
            },
            self.buffer.over(buffer),
        )
    }
}

/// The fields a set gives (`Change::SetLink`'s).
#[derive(Clone, Copy, Debug)]
struct Fields {
    rate: Option<Bandwidth>,
    delay: Option<Duration>,
    loss: Option<f64>,
    loss_burst: Option<f64>,
    buffer: Option<Bytes>,
}

/// How to apply a change, once noted.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Outcome {
    /// As it is.
    AsIs,
    /// Not at all: the link stays down, held by these timelines (0: by hand).
    HeldDown(BTreeSet<u64>),
    /// Instead, a direction at a time, these values: the link's own (`hand`: set by hand)
    /// under the degrades still in place (of the timelines `degraded_by`).
    Restore {
        values: [Values; 2],
        hand: bool,
        degraded_by: BTreeSet<u64>,
    },
    /// Instead, this partition (a group per GPU; none: heal): every partition in place at
    /// once, those of the timelines `others` besides the change's own.
    Regroup {
        groups: Option<Vec<u16>>,
        others: BTreeSet<u64>,
    },
}

#[derive(Debug, Default)]
pub(super) struct Layers {
    /// Links down: who holds each down.
    down: HashMap<u32, BTreeSet<Holder>>,
    /// Links degraded by timelines: a direction each.
    degrades: HashMap<u32, [Degrades; 2]>,
    /// Links set by hand and not reset by hand since: each direction's own values.
    by_hand: HashMap<u32, [Values; 2]>,
    /// Partitions in place: each timeline's groups, the latest last.
    partitions: Vec<(Holder, Vec<u16>)>,
    /// Timelines still running (steps pending or loads running). What an ended timeline
    /// left broken for good is anyone's to repair: a later scenario's repair of the link
    /// lets go of it too (nobody else would), and only the latest of those is kept.
    live: BTreeSet<u64>,
}

impl Layers {
    /// Notes `change`, made by `t` (a timeline's fault; timeline 0: by hand), and says
    /// how to apply it. `original(link, end)` is the topology's values of the direction
    /// leaving `end`.
    pub(super) fn take(
        &mut self,
        t: impl Into<Holder>,
        change: &Change,
        original: impl Fn(u32, usize) -> Values,
    ) -> Outcome {
        let t = t.into();
        let live = &self.live;
        // What `t` lets go of when it repairs: its own, and what ended timelines left
        // (a host, only its own: setting its interface up does not mend a cable).
        let gone = |u: Holder| u == t || (!t.is_host() && u.ended(live));
        match *change {
            Change::LinkDown(l) => {
                self.down.entry(l).or_default().insert(t);
                Outcome::AsIs
            }
            Change::LinkUp(l) => {
                let Some(holders) = self.down.get_mut(&l) else {
                    return Outcome::AsIs;
                };
                if t == HAND {
                    // All but the hosts'.
                    holders.retain(|u| u.is_host());
                } else {
                    holders.retain(|&u| !gone(u));
                }
                if holders.is_empty() {
                    self.down.remove(&l);
                    Outcome::AsIs
                } else {
                    Outcome::HeldDown(holders.iter().map(|h| h.timeline).collect())
                }
            }
            Change::SetLink {
                link,
                dirs,
                rate,
                delay,
                loss,
                loss_burst,
                buffer,
            } => {
                let f = Fields {
                    rate,
                    delay,
                    loss,
                    loss_burst,
                    buffer,
                };
                for p in dirs.ports(link) {
                    let end = (p.0 % 2) as usize;
                    if t == HAND {
                        self.set_by_hand(link, end, f, &original);
                    } else {
                        self.degrade(link, end, t, f);
                    }
                }
                Outcome::AsIs
            }
            Change::ResetLink(l) if t == HAND => {
                self.by_hand.remove(&l);
                self.degrades.remove(&l);
                Outcome::AsIs
            }
            Change::ResetLink(l) => {
                let mut degraded_by = BTreeSet::new();
                if let Some(d) = self.degrades.get_mut(&l) {
                    for dir in d.iter_mut() {
                        dir.release_if(gone);
                        dir.timelines(&mut degraded_by);
                    }
                    if degraded_by.is_empty() {
                        self.degrades.remove(&l);
                    }
                }
                let hand = self.by_hand.contains_key(&l);
                if !hand && degraded_by.is_empty() {
                    return Outcome::AsIs;
                }
                Outcome::Restore {
                    values: [0, 1].map(|end| self.values(l, end, &original)),
                    hand,
                    degraded_by,
                }
            }
            Change::Partition(ref groups) => {
                self.partitions.retain(|(u, _)| *u != t);
                self.partitions.push((t, groups.clone()));
                self.regroup(t)
            }
            Change::Heal if t == HAND => {
                self.partitions.clear();
                Outcome::AsIs
            }
            Change::Heal => {
                self.partitions.retain(|&(u, _)| !gone(u));
                self.regroup(t)
            }
            _ => Outcome::AsIs,
        }
    }

    /// The partitions in place as one, for a change of timeline `t`'s: two GPUs are on one
    /// side when every partition puts them on one side. One partition is itself.
    fn regroup(&self, t: Holder) -> Outcome {
        let others = self
            .partitions
            .iter()
            .filter(|(u, _)| *u != t)
            .map(|(u, _)| u.timeline)
            .collect();
        let groups = match self.partitions.as_slice() {
            [] => None,
            [(_, one)] => Some(one.clone()),
            all => {
                let gpus = all[0].1.len();
                let mut sides: HashMap<Vec<u16>, u16> = HashMap::new();
                let groups = (0..gpus)
                    .map(|h| {
                        let key: Vec<u16> = all.iter().map(|(_, g)| g[h]).collect();
                        let next = sides.len() as u16;
                        *sides.entry(key).or_insert(next)
                    })
                    .collect();
                Some(groups)
            }
        };
        Outcome::Regroup { groups, others }
    }

    /// What link `l`'s direction leaving `end` is now: its own values under the degrades
    /// in place.
    fn values(&self, l: u32, end: usize, original: &impl Fn(u32, usize) -> Values) -> Values {
        let own = self
            .by_hand
            .get(&l)
            .map_or_else(|| original(l, end), |h| h[end]);
        self.degrades.get(&l).map_or(own, |d| d[end].over(own))
    }

    fn set_by_hand(
        &mut self,
        l: u32,
        end: usize,
        f: Fields,
        original: &impl Fn(u32, usize) -> Values,
    ) {
        let own = self
            .by_hand
            .entry(l)
            .or_insert_with(|| [original(l, 0), original(l, 1)]);
        let (link, buffer) = &mut own[end];
        link.rate = f.rate.unwrap_or(link.rate);
        link.delay = f.delay.unwrap_or(link.delay);
        link.loss = f.loss.unwrap_or(link.loss);
        link.loss_burst = f.loss_burst.unwrap_or(link.loss_burst);
        *buffer = f.buffer.unwrap_or(*buffer);
        // What the hand sets shows at once and stays when degrades are repaired.
        if let Some(d) = self.degrades.get_mut(&l) {
            let d = &mut d[end];
            if f.rate.is_some() {
                d.rate = Stack::default();
            }
            if f.delay.is_some() {
                d.delay = Stack::default();
            }
            if f.loss.is_some() {
                d.loss = Stack::default();
            }
            if f.loss_burst.is_some() {
                d.loss_burst = Stack::default();
            }
            if f.buffer.is_some() {
                d.buffer = Stack::default();
            }
        }
    }

    fn degrade(&mut self, l: u32, end: usize, t: Holder, f: Fields) {
        let d = &mut self.degrades.entry(l).or_default()[end];
        if let Some(v) = f.rate {
            d.rate.set(t, v);
        }
        if let Some(v) = f.delay {
            d.delay.set(t, v);
        }
        if let Some(v) = f.loss {
            d.loss.set(t, v);
        }
        if let Some(v) = f.loss_burst {
            d.loss_burst.set(t, v);
        }
        if let Some(v) = f.buffer {
            d.buffer.set(t, v);
        }
    }

    /// Timeline `t` starts: until it `end`s, only its own repairs (or the hand) undo
    /// what it holds.
    pub(super) fn begin(&mut self, t: u64) {
        if t != 0 {
            self.live.insert(t);
        }
    }

    /// The timelines that `running` no longer says run have ended (see `live`).
    pub(super) fn end_unless(&mut self, running: impl Fn(u64) -> bool) {
        let before = self.live.len();
        self.live.retain(|&t| running(t));
        if self.live.len() == before {
            return;
        }
        let live = &self.live;
        let ended = |u: Holder| u.ended(live);
        for d in self.degrades.values_mut().flatten() {
            d.compact(ended);
        }
        for holders in self.down.values_mut() {
            if let Some(&last) = holders.iter().rev().find(|&&u| ended(u)) {
                holders.retain(|&u| u == last || !ended(u));
            }
        }
        // Ended partitions as one (they apply together whoever made them).
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.partitions)
            .into_iter()
            .partition(|(u, _)| ended(*u));
        self.partitions = kept;
        if let Some(&(last, _)) = gone.last() {
            let one = Layers {
                partitions: gone,
                ..Layers::default()
            };
            if let Outcome::Regroup {
                groups: Some(groups),
                ..
            } = one.regroup(last)
            {
                self.partitions.insert(0, (last, groups));
            }
        }
    }

    /// The timelines holding link `l` down (0: by hand), not counting its GPU's host.
    pub(super) fn down_by(&self, l: u32) -> Vec<u64> {
        self.down.get(&l).map_or_else(Vec::new, |h| {
            let by: BTreeSet<u64> = h.iter().map(|h| h.timeline).collect();
            by.into_iter().filter(|&t| t != HOST).collect()
        })
    }

    /// Whether its GPU's host holds link `l` down.
    pub(super) fn down_by_host(&self, l: u32) -> bool {
        self.down_holders(l).any(Holder::is_host)
    }

    /// The timelines whose degrades of link `l` are in place.
    pub(super) fn degraded_by(&self, l: u32) -> Vec<u64> {
        let mut by = BTreeSet::new();
        for d in self.degrades.get(&l).into_iter().flatten() {
            d.timelines(&mut by);
        }
        by.into_iter().collect()
    }

    /// Forgets every hold but the GPUs' hosts' (a fabric reset: what a host did to its
    /// own interface is its to undo).
    pub(super) fn clear(&mut self) {
        let mut down = std::mem::take(&mut self.down);
        for holders in down.values_mut() {
            holders.retain(|u| u.is_host());
        }
        down.retain(|_, holders| !holders.is_empty());
        *self = Layers {
            down,
            ..Layers::default()
        };
    }

    /// What link `l`'s direction leaving `end` should be now: its own values under the
    /// degrades in place (the model must agree).
    #[cfg(test)]
    pub(super) fn expected(
        &self,
        l: u32,
        end: usize,
        original: impl Fn(u32, usize) -> Values,
    ) -> Values {
        self.values(l, end, &original)
    }

    /// Whether anyone holds link `l` down.
    #[cfg(test)]
    pub(super) fn held_down(&self, l: u32) -> bool {
        self.down.contains_key(&l)
    }

    /// Who holds link `l` down.
    pub(super) fn down_holders(&self, l: u32) -> impl Iterator<Item = Holder> + '_ {
        self.down.get(&l).into_iter().flatten().copied()
    }

    /// Nothing held (timelines may still run).
    #[cfg(test)]
    pub(super) fn is_empty(&self) -> bool {
        self.down.is_empty()
            && self.degrades.is_empty()
            && self.by_hand.is_empty()
            && self.partitions.is_empty()
    }
}

/// "timeline 2", "timelines 2, 3", "hand", "hand and timeline 2", "its GPU's host, whose
/// interface is down": who holds a link (0: by hand; `HOST`: its GPU's host), in that
/// order.
pub fn holders(ids: impl IntoIterator<Item = u64>) -> String {
    let mut hand = false;
    let mut host = false;
    let mut timelines = Vec::new();
    for t in ids {
        match t {
            0 => hand = true,
            HOST => host = true,
            t => timelines.push(t.to_string()),
        }
    }
    let mut who = Vec::new();
    if hand {
        who.push("hand".to_owned());
    }
    match timelines.len() {
        0 => {}
        1 => who.push(format!("timeline {}", timelines[0])),
        _ => who.push(format!("timelines {}", timelines.join(", "))),
    }
    if host {
        who.push("its GPU's host, whose interface is down".to_owned());
    }
    match who.is_empty() {
        true => "nobody".into(),
        false => who.join(" and "),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use closbox_fabric::model::Directions;

    fn original(_: u32, _: usize) -> Values {
        (
            LinkParams {
                rate: Bandwidth::from_bps(1_000_000_000),
                delay: Duration::from_nanos(1_000),
                loss: 0.0,
                loss_burst: 1.0,
            },
            Bytes::new(100_000),
        )
    }

    fn set(rate: Option<u64>, loss: Option<f64>, dirs: Directions) -> Change {
        Change::SetLink {
            link: 3,
            dirs,
            rate: rate.map(Bandwidth::from_bps),
            delay: None,
            loss,
            loss_burst: None,
            buffer: None,
        }
    }

    fn restored(o: Outcome) -> ([Values; 2], bool, Vec<u64>) {
        match o {
            Outcome::Restore {
                values,
                hand,
                degraded_by,
            } => (values, hand, degraded_by.into_iter().collect()),
            o => panic!("{o:?}"),
        }
    }

    #[test]
    fn a_link_is_down_while_anyone_holds_it() {
        let mut l = Layers::default();
        (1..=5).for_each(|t| l.begin(t));
        assert_eq!(l.take(1, &Change::LinkDown(3), original), Outcome::AsIs);
        assert_eq!(l.take(2, &Change::LinkDown(3), original), Outcome::AsIs);
        assert_eq!(
            l.take(1, &Change::LinkUp(3), original),
            Outcome::HeldDown([2].into())
        );
        // Again (a repair after the up): still timeline 2's.
        assert_eq!(
            l.take(1, &Change::LinkUp(3), original),
            Outcome::HeldDown([2].into())
        );
        assert_eq!(l.take(2, &Change::LinkUp(3), original), Outcome::AsIs);
        assert!(l.is_empty());
        // Down by hand: a scenario's up does not bring it back; up by hand ends every hold.
        l.take(HAND, &Change::LinkDown(3), original);
        l.take(4, &Change::LinkDown(3), original);
        assert_eq!(
            l.take(4, &Change::LinkUp(3), original),
            Outcome::HeldDown([0].into())
        );
        l.take(5, &Change::LinkDown(3), original);
        assert_eq!(l.take(HAND, &Change::LinkUp(3), original), Outcome::AsIs);
        assert!(l.is_empty());
    }

    #[test]
    fn a_gpus_host_holds_its_links_down_against_everyone_else() {
        let mut l = Layers::default();
        l.begin(1);
        let host = Holder::host(3);
        assert_eq!(l.take(host, &Change::LinkDown(9), original), Outcome::AsIs);
        l.take(1, &Change::LinkDown(9), original);
        // Neither a scenario's up nor the hand's brings it up, nor a fabric reset.
        let held = Outcome::HeldDown([HOST].into());
        assert_eq!(l.take(1, &Change::LinkUp(9), original), held);
        l.take(HAND, &Change::LinkDown(9), original);
        assert_eq!(l.take(HAND, &Change::LinkUp(9), original), held);
        l.end_unless(|_| false);
        l.take(2, &Change::LinkDown(9), original);
        l.clear();
        assert!(l.held_down(9) && l.down_by_host(9));
        assert!(l.down_by(9).is_empty(), "{:?}", l.down_by(9));
        // Another GPU's host's up is not its own.
        let other = Holder::host(4);
        assert_eq!(l.take(other, &Change::LinkUp(9), original), held);
        // Its own up: the link comes up, unless someone took it down meanwhile.
        l.take(HAND, &Change::LinkDown(9), original);
        let by_hand = Outcome::HeldDown([0].into());
        assert_eq!(l.take(host, &Change::LinkUp(9), original), by_hand);
        assert!(!l.down_by_host(9));
        assert_eq!(l.take(HAND, &Change::LinkUp(9), original), Outcome::AsIs);
        assert!(l.is_empty());
    }

    #[test]
    fn a_repair_ends_its_own_degrade_only() {
        let mut l = Layers::default();
        (1..=7).for_each(|t| l.begin(t));
        // Timeline 1 halves the rate, timeline 2 adds loss and then a lower rate.
        l.take(1, &set(Some(500_000_000), None, Directions::Both), original);
        l.take(2, &set(None, Some(0.1), Directions::Both), original);
        l.take(
            2,
            &set(Some(100_000_000), None, Directions::FromA),
            original,
        );
        // Timeline 2's repair: timeline 1's rate back, both ways; no loss.
        let (v, hand, by) = restored(l.take(2, &Change::ResetLink(3), original));
        assert!(!hand);
        assert_eq!(by, [1]);
        for (link, buffer) in v {
            assert_eq!(link.rate.bps(), 500_000_000);
            assert_eq!(link.loss, 0.0);
            assert_eq!(buffer, Bytes::new(100_000));
        }
        // Timeline 1's: nothing left, a plain reset to the topology's.
        assert_eq!(l.take(1, &Change::ResetLink(3), original), Outcome::AsIs);
        assert!(l.is_empty());
        // The latest degrade of a field shows, whichever repair comes first.
        l.take(1, &set(Some(500_000_000), None, Directions::Both), original);
        l.take(2, &set(Some(100_000_000), None, Directions::Both), original);
        let (v, _, by) = restored(l.take(1, &Change::ResetLink(3), original));
        assert_eq!(by, [2]);
        assert_eq!(v[0].0.rate.bps(), 100_000_000);
        // A reset by a timeline that degraded nothing leaves the others' in place.
        let (v, _, by) = restored(l.take(7, &Change::ResetLink(3), original));
        assert_eq!(by, [2]);
        assert_eq!(v[1].0.rate.bps(), 100_000_000);
    }

    #[test]
    fn the_hand_sets_the_links_own_values_and_wins_over_degrades() {
        let mut l = Layers::default();
        (1..=2).for_each(|t| l.begin(t));
        l.take(
            1,
            &set(Some(100_000_000), Some(0.2), Directions::Both),
            original,
        );
        // By hand, one direction's rate: it shows there at once (the set applied as is)
        // and stays when timeline 1 ends; the degrade's loss goes with it.
        l.take(
            HAND,
            &set(Some(300_000_000), None, Directions::FromB),
            original,
        );
        let (v, hand, by) = restored(l.take(1, &Change::ResetLink(3), original));
        assert!(hand);
        assert!(by.is_empty());
        assert_eq!(v[0].0.rate.bps(), 1_000_000_000);
        assert_eq!(v[1].0.rate.bps(), 300_000_000);
        assert_eq!((v[0].0.loss, v[1].0.loss), (0.0, 0.0));
        // A degrade over it, repaired: back to what the hand set.
        l.take(2, &set(Some(10_000_000), None, Directions::Both), original);
        let (v, hand, _) = restored(l.take(2, &Change::ResetLink(3), original));
        assert!(hand);
        assert_eq!(v[1].0.rate.bps(), 300_000_000);
        // A reset by hand forgets the hand's values and every degrade.
        l.take(2, &set(Some(10_000_000), None, Directions::Both), original);
        assert_eq!(l.take(HAND, &Change::ResetLink(3), original), Outcome::AsIs);
        assert!(l.is_empty());
        assert_eq!(l.take(2, &Change::ResetLink(3), original), Outcome::AsIs);
    }

    #[test]
    fn partitions_in_place_apply_together_and_heal_one_by_one() {
        let mut l = Layers::default();
        (1..=2).for_each(|t| l.begin(t));
        let regroup = |o: Outcome| match o {
            Outcome::Regroup { groups, others } => (groups, others.into_iter().collect()),
            o => panic!("{o:?}"),
        };
        // Timeline 1 cuts 4 GPUs in halves, timeline 2 cuts GPU 3 off.
        let (g, others): (_, Vec<u64>) =
            regroup(l.take(1, &Change::Partition(vec![0, 0, 1, 1]), original));
        assert_eq!((g, others), (Some(vec![0, 0, 1, 1]), vec![]));
        let (g, others) = regroup(l.take(2, &Change::Partition(vec![1, 1, 1, 0]), original));
        assert_eq!((g, others), (Some(vec![0, 0, 1, 2]), vec![1]));
        // Timeline 1 heals: timeline 2's stays; then it heals too.
        let (g, others) = regroup(l.take(1, &Change::Heal, original));
        assert_eq!((g, others), (Some(vec![1, 1, 1, 0]), vec![2]));
        let (g, others) = regroup(l.take(2, &Change::Heal, original));
        assert_eq!((g, others), (None, vec![]));
        assert!(l.is_empty());
        // A heal by hand ends every partition.
        l.take(1, &Change::Partition(vec![0, 0, 1, 1]), original);
        l.take(HAND, &Change::Partition(vec![0, 1, 1, 1]), original);
        assert_eq!(l.take(HAND, &Change::Heal, original), Outcome::AsIs);
        assert!(l.is_empty());
    }

    #[test]
    fn what_an_ended_timeline_left_is_anyones_to_repair() {
        let mut l = Layers::default();
        (1..=4).for_each(|t| l.begin(t));
        // Timelines 1 and 2 degrade the rate for good and end; 3 is still running.
        l.take(1, &set(Some(100_000_000), None, Directions::Both), original);
        l.take(3, &set(None, Some(0.1), Directions::Both), original);
        l.take(2, &set(Some(200_000_000), None, Directions::Both), original);
        l.take(1, &Change::LinkDown(3), original);
        l.take(2, &Change::LinkDown(3), original);
        l.take(1, &Change::Partition(vec![0, 1]), original);
        l.take(2, &Change::Partition(vec![0, 0]), original);
        l.end_unless(|t| t > 2);
        // Only the latest ended value of a field is kept, one ended holder of a link.
        assert_eq!(l.degrades[&3][0].rate.0.len(), 1);
        assert_eq!(l.down_by(3), [2]);
        assert_eq!(l.partitions, [(2.into(), vec![0, 1])]);
        // Timeline 4's repairs let go of them; timeline 3's degrade stays.
        let (v, _, by) = restored(l.take(4, &Change::ResetLink(3), original));
        assert_eq!(by, [3]);
        assert_eq!(v[0].0.rate.bps(), 1_000_000_000);
        assert_eq!(v[0].0.loss, 0.1);
        assert_eq!(l.take(4, &Change::LinkUp(3), original), Outcome::AsIs);
        let Outcome::Regroup { groups, .. } = l.take(4, &Change::Heal, original) else {
            panic!()
        };
        assert_eq!(groups, None);
    }

    #[test]
    fn faults_of_one_timeline_are_undone_one_by_one() {
        let mut l = Layers::default();
        l.begin(1);
        let fault = |fault| Holder { timeline: 1, fault };
        // A random switch fault and a random link fault of one scenario on one link.
        l.take(fault(1), &Change::LinkDown(3), original);
        l.take(fault(2), &Change::LinkDown(3), original);
        assert_eq!(
            l.take(fault(2), &Change::LinkUp(3), original),
            Outcome::HeldDown([1].into())
        );
        assert_eq!(
            l.take(fault(1), &Change::LinkUp(3), original),
            Outcome::AsIs
        );
        // Two degrades: the first's repair leaves the second's loss.
        l.take(
            fault(1),
            &set(Some(10_000_000), None, Directions::Both),
            original,
        );
        l.take(fault(2), &set(None, Some(0.5), Directions::Both), original);
        let (v, _, by) = restored(l.take(fault(1), &Change::ResetLink(3), original));
        assert_eq!(by, [1]);
        assert_eq!((v[0].0.rate.bps(), v[0].0.loss), (1_000_000_000, 0.5));
        // A flap by hand (timeline 0, a fault of its own) does not undo a down by hand.
        let flap = Holder {
            timeline: 0,
            fault: 1 << 31,
        };
        l.take(HAND, &Change::LinkDown(4), original);
        l.take(flap, &Change::LinkDown(4), original);
        assert_eq!(
            l.take(flap, &Change::LinkUp(4), original),
            Outcome::HeldDown([0].into())
        );
    }

    #[test]
    fn holders_are_named() {
        assert_eq!(holders([2]), "timeline 2");
        assert_eq!(holders([2, 3]), "timelines 2, 3");
        assert_eq!(holders([0]), "hand");
        assert_eq!(holders([0, 4]), "hand and timeline 4");
        let host = "its GPU's host, whose interface is down";
        assert_eq!(holders([HOST]), host);
        assert_eq!(
            holders([0, 2, HOST]),
            format!("hand and timeline 2 and {host}")
        );
        assert_eq!(holders([]), "nobody");
    }
}
