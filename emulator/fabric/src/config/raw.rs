//! The file as written: serde structs that reject unknown keys and keep each value's
//! position (`Spanned`) for errors. Nothing is checked here but types.

use serde::Deserialize;
use toml::Spanned;

use crate::units::{Bandwidth, Bytes, Duration};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawFile {
    pub(super) fabric: RawFabric,
    pub(super) topology: Spanned<RawTopology>,
    pub(super) node: Option<RawNode>,
    pub(super) nic: Option<RawQueue>,
    #[serde(default)]
    pub(super) links: RawLinks,
    #[serde(default)]
    pub(super) switches: RawSwitches,
    #[serde(default, rename = "switch")]
    pub(super) switch_list: Vec<Spanned<RawSwitch>>,
    #[serde(default, rename = "host")]
    pub(super) host_list: Vec<Spanned<RawHost>>,
    #[serde(default, rename = "link")]
    pub(super) link_list: Vec<Spanned<RawLink>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawFabric {
    pub(super) name: Spanned<String>,
    #[serde(default)]
    pub(super) seed: u64,
    pub(super) time_scale: Option<Spanned<RawTimeScale>>,
    pub(super) address_pool: Option<Spanned<String>>,
    pub(super) mtu: Option<Spanned<i64>>,
    pub(super) l2_overhead: Option<Spanned<Bytes>>,
    pub(super) packet_memory: Option<Spanned<Bytes>>,
    pub(super) failure_detection: Option<Spanned<Duration>>,
    pub(super) route_convergence: Option<Spanned<Duration>>,
    pub(super) preset: Option<Spanned<String>>,
    pub(super) flow_control: Option<Spanned<String>>,
    pub(super) xoff: Option<Spanned<Bytes>>,
    pub(super) xon: Option<Spanned<Bytes>>,
    pub(super) deadlock_after: Option<Spanned<Duration>>,
}

/// `time_scale = 4000` or `time_scale = "auto"`. (Not `#[serde(untagged)]`: its error for
/// any other value names the Rust enum.)
pub(super) enum RawTimeScale {
    Number(f64),
    Word(String),
}

impl<'de> Deserialize<'de> for RawTimeScale {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = RawTimeScale;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a number (1 is real time) or \"auto\"")
            }
            fn visit_i64<E>(self, v: i64) -> Result<RawTimeScale, E> {
                Ok(RawTimeScale::Number(v as f64))
            }
            fn visit_u64<E>(self, v: u64) -> Result<RawTimeScale, E> {
                Ok(RawTimeScale::Number(v as f64))
            }
            fn visit_f64<E>(self, v: f64) -> Result<RawTimeScale, E> {
                Ok(RawTimeScale::Number(v))
            }
            fn visit_str<E>(self, v: &str) -> Result<RawTimeScale, E> {
                Ok(RawTimeScale::Word(v.to_owned()))
            }
        }
        d.deserialize_any(Visitor)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTopology {
    pub(super) kind: Spanned<String>,
    pub(super) gpus: Option<Spanned<i64>>,
    pub(super) nodes: Option<Spanned<i64>>,
    pub(super) leaves: Option<Spanned<i64>>,
    pub(super) spines: Option<Spanned<i64>>,
    pub(super) gpus_per_leaf: Option<Spanned<i64>>,
    pub(super) nodes_per_leaf: Option<Spanned<i64>>,
    pub(super) uplinks: Option<Spanned<i64>>,
    pub(super) k: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawNode {
    pub(super) gpus_per_node: Option<Spanned<i64>>,
    pub(super) rate: Option<Bandwidth>,
    pub(super) delay: Option<Spanned<Duration>>,
    pub(super) latency: Option<Spanned<Duration>>,
    pub(super) buffer: Option<Spanned<Bytes>>,
    pub(super) ecn: Option<Spanned<RawEcn>>,
    pub(super) loss: Option<Spanned<f64>>,
    pub(super) loss_burst: Option<Spanned<f64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawQueue {
    pub(super) buffer: Option<Spanned<Bytes>>,
    pub(super) ecn: Option<Spanned<RawEcn>>,
    pub(super) tcp_congestion: Option<Spanned<String>>,
    pub(super) tcp_ecn: Option<Spanned<bool>>,
    pub(super) tcp_slow_start_after_idle: Option<bool>,
    pub(super) scheduler: Option<Spanned<String>>,
}

#[derive(Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEcn {
    pub(super) k: Option<Spanned<Bytes>>,
    pub(super) min: Option<Spanned<Bytes>>,
    pub(super) max: Option<Spanned<Bytes>>,
    pub(super) p_max: Option<Spanned<f64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLinkClass {
    pub(super) rate: Option<Bandwidth>,
    pub(super) delay: Option<Spanned<Duration>>,
    pub(super) loss: Option<Spanned<f64>>,
    pub(super) loss_burst: Option<Spanned<f64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLinks {
    pub(super) nic: Option<RawLinkClass>,
    #[serde(rename = "leaf-spine")]
    pub(super) leaf_spine: Option<RawLinkClass>,
    #[serde(rename = "spine-core")]
    pub(super) spine_core: Option<RawLinkClass>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSwitchTier {
    pub(super) latency: Option<Spanned<Duration>>,
    pub(super) buffer: Option<Spanned<Bytes>>,
    pub(super) ecn: Option<Spanned<RawEcn>>,
    pub(super) routing: Option<Spanned<String>>,
    pub(super) radix: Option<Spanned<i64>>,
    pub(super) icmp_rate: Option<Spanned<i64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSwitches {
    pub(super) leaf: Option<RawSwitchTier>,
    pub(super) spine: Option<RawSwitchTier>,
    pub(super) core: Option<RawSwitchTier>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSwitch {
    pub(super) name: Spanned<String>,
    pub(super) tier: Spanned<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawHost {
    pub(super) name: Spanned<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLink {
    pub(super) a: Spanned<String>,
    pub(super) b: Spanned<String>,
    pub(super) class: Option<Spanned<String>>,
    pub(super) count: Option<Spanned<i64>>,
    pub(super) rate: Option<Bandwidth>,
    pub(super) delay: Option<Spanned<Duration>>,
    pub(super) loss: Option<Spanned<f64>>,
    pub(super) loss_burst: Option<Spanned<f64>>,
}
