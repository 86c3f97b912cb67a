//! `hostile`: a test plugin that misbehaves on purpose in `on-request` (and `on-disconnect`),
//! chosen by its configuration, so the gateway's limits are tested against real components:
//! `loop` (never returns: the epoch deadline), `memory` (grows memory without end, or by `mib`
//! MiB and then allows: the store's memory limit), `trap` (panics: a trap), `bad-status` (denies with a status that is not a
//! 4xx) and `bad-header` (adds a header that is not valid HTTP): garbage verdicts; `sleep`
//! (waits 5 s in a WASI clock, where no epoch deadline can stop it: the call's timeout);
//! `big-header` (allows, adding one 8 MiB header: more than the gateway copies out of a call);
//! `observe` (allows, tagging what it reads of WASI's clocks and randomness: the host should
//! give it nothing to tell one call from another); `log-flood` (allows, after asking the host to
//! log a thousand lines: the log's bounds); `busy` (allows after counting to `rounds`: a call
//! that takes its time but ends).

use std::hash::BuildHasher as _;

use bulkhead_policy_guest::{
    ConfigSlot, Denial, Directive, Disconnect, Guest, Header, Hooks, Level, Mutations, RequestView,
    ResponseEnd, Tag, Verdict, configured, log, parse_config, store,
};
use serde::Deserialize;

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum Attack {
    Loop,
    Memory,
    Trap,
    BadStatus,
    BadHeader,
    Sleep,
    Observe,
    BigHeader,
    LogFlood,
    Busy,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    attack: Attack,
    /// How far `busy` counts.
    #[serde(default)]
    rounds: u64,
    /// How many MiB `memory` takes before it allows; without it, no end.
    #[serde(default)]
    mib: Option<usize>,
}

thread_local! {
    static CONFIG: ConfigSlot<Config> = const { ConfigSlot::new(None) };
}

fn spin() -> ! {
    let mut n: u64 = 0;
    loop {
        n = std::hint::black_box(n.wrapping_add(1));
    }
}

/// Holds `mib` MiB (or grows without end), then says how many it holds.
fn bomb(mib: Option<usize>) -> usize {
    let mut hoard: Vec<Vec<u8>> = Vec::new();
    loop {
        hoard.push(vec![1u8; 1 << 20]);
        std::hint::black_box(&hoard);
        if Some(hoard.len()) == mib || hoard.len() == usize::MAX {
            return hoard.len();
        }
    }
}

fn attack(c: &Config) -> Verdict {
    match c.attack {
        Attack::Loop => spin(),
        Attack::Memory => {
            let n = bomb(c.mib);
            Verdict::Allow(Mutations {
                tags: vec![Tag {
                    key: "held-mib".into(),
                    value: n.to_string(),
                }],
                clamp_max_tokens: None,
                add_headers: Vec::new(),
            })
        }
        Attack::Trap => panic!("hostile plugin: trap on purpose"),
        Attack::BadStatus => Verdict::Deny(Denial {
            status: 200,
            message: "a denial that says OK".into(),
        }),
        Attack::Sleep => {
            std::thread::sleep(std::time::Duration::from_secs(5));
            Verdict::Allow(Mutations {
                tags: Vec::new(),
                clamp_max_tokens: None,
                add_headers: Vec::new(),
            })
        }
        Attack::Observe => {
            let wall = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(u128::MAX, |d| d.as_nanos());
            let tag = |key: &str, value: String| Tag {
                key: key.into(),
                value,
            };
            // A fresh `RandomState` is keyed from WASI's random source.
            let random = std::collections::hash_map::RandomState::new().hash_one(0u8);
            Verdict::Allow(Mutations {
                tags: vec![
                    tag("wall-clock-ns", wall.to_string()),
                    tag("random", format!("{random:016x}")),
                ],
                clamp_max_tokens: None,
                add_headers: Vec::new(),
            })
        }
        Attack::Busy => {
            let mut n: u64 = 0;
            while n < c.rounds {
                n = std::hint::black_box(n + 1);
            }
            Verdict::Allow(Mutations {
                tags: Vec::new(),
                clamp_max_tokens: None,
                add_headers: Vec::new(),
            })
        }
        Attack::LogFlood => {
            for n in 0..1000 {
                log(Level::Warn, &format!("hostile plugin: line {n}"));
            }
            Verdict::Allow(Mutations {
                tags: Vec::new(),
                clamp_max_tokens: None,
                add_headers: Vec::new(),
            })
        }
        Attack::BigHeader => Verdict::Allow(Mutations {
            tags: Vec::new(),
            clamp_max_tokens: None,
            add_headers: vec![Header {
                name: "x-big".into(),
                value: "a".repeat(8 << 20),
            }],
        }),
        Attack::BadHeader => Verdict::Allow(Mutations {
            tags: Vec::new(),
            clamp_max_tokens: None,
            add_headers: vec![Header {
                name: "bad header\r\nset-cookie".into(),
                value: "x".into(),
            }],
        }),
    }
}

struct Hostile;

impl Guest for Hostile {
    fn configure(config: String) -> Result<Hooks, String> {
        store(&CONFIG, parse_config::<Config>(&config)?);
        Ok(Hooks::ON_REQUEST | Hooks::ON_DISCONNECT)
    }

    fn on_request(_: RequestView) -> Verdict {
        configured(&CONFIG, attack)
    }

    fn on_disconnect(_: Disconnect) -> Directive {
        configured(&CONFIG, |c| match attack(c) {
            Verdict::Allow(_) | Verdict::Deny(_) => Directive::HoldUntilComplete,
        })
    }

    fn on_response_end(_: ResponseEnd) {}
}

bulkhead_policy_guest::export!(Hostile with_types_in bulkhead_policy_guest::bindings);
