//! The gateway bench's figures: per target, medians over runs; against the baseline and the
//! peers, the median of each run's paired figure (every run measures every target once, back
//! to back, so a slow phase of a shared machine hits the pair alike). A table and one JSON
//! object.

use serde_json::{Map, Value, json};

use super::median;
use super::targets::Kind;

/// One target in one run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Figures {
    pub rps: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub requests: usize,
    pub errors: u64,
    /// CPU microseconds the target's processes spent per answer; `None` where not metered.
    pub cpu_us: Option<f64>,
}

/// Every target's figures, run by run (index `i` of every list is run `i`), and the targets
/// skipped with the reason.
#[derive(Debug, Clone, Default)]
pub struct Results {
    pub measured: Vec<(Kind, Vec<Figures>)>,
    pub skipped: Vec<(Kind, String)>,
    /// The load was paced (every target offered the same requests/s): throughput goals are
    /// not judged.
    pub paced: bool,
}

impl Results {
    fn runs(&self, kind: Kind) -> Option<&[Figures]> {
        self.measured
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, f)| f.as_slice())
    }

    /// The median over runs of `f(this run's a, this run's b)`, if both were measured.
    fn paired(&self, a: Kind, b: Kind, f: impl Fn(&Figures, &Figures) -> f64) -> Option<f64> {
        self.paired_where(a, b, |x, y| Some(f(x, y)))
    }

    /// The median over the runs where `f` has a figure.
    fn paired_where(
        &self,
        a: Kind,
        b: Kind,
        f: impl Fn(&Figures, &Figures) -> Option<f64>,
    ) -> Option<f64> {
        let (a, b) = (self.runs(a)?, self.runs(b)?);
        let v: Vec<f64> = a.iter().zip(b).filter_map(|(x, y)| f(x, y)).collect();
        (!v.is_empty()).then(|| median(v))
    }

    /// `kind`'s CPU per request over `peer`'s, paired by run.
    fn cpu_ratio(&self, kind: Kind, peer: Kind) -> Option<f64> {
        self.paired_where(kind, peer, |a, b| Some(a.cpu_us? / b.cpu_us?))
    }

    /// The median over runs of a target's CPU per request, where metered.
    fn cpu_us(&self, kind: Kind) -> Option<f64> {
        let v: Vec<f64> = self.runs(kind)?.iter().filter_map(|f| f.cpu_us).collect();
        (!v.is_empty()).then(|| median(v))
    }

    fn vs(&self, kind: Kind, peer: Kind) -> Option<Value> {
        let rps = self.paired(kind, peer, |a, b| a.rps / b.rps)?;
        let p50 = self.paired(kind, peer, |a, b| a.p50_us / b.p50_us)?;
        let mut v = json!({"rps_ratio": rps, "p50_ratio": p50});
        if let Some(cpu) = self.cpu_ratio(kind, peer) {
            v["cpu_per_request_ratio"] = json!(cpu);
        }
        Some(v)
    }

    /// The policy chain's cost: requests/s with it on over off, the added p50 and p99, and
    /// the added CPU per request where metered.
    fn policy_chain(&self) -> Option<Value> {
        let (on, off) = (Kind::BulkheadPolicies, Kind::Bulkhead);
        let mut v = json!({
            "rps_on_vs_off": self.paired(on, off, |a, b| a.rps / b.rps)?,
            "added_p50_us": self.paired(on, off, |a, b| a.p50_us - b.p50_us)?,
            "added_p99_us": self.paired(on, off, |a, b| a.p99_us - b.p99_us)?,
        });
        if let Some(cpu) = self.paired_where(on, off, |a, b| Some(a.cpu_us? - b.cpu_us?)) {
            v["added_cpu_us_per_request"] = json!(cpu);
        }
        Some(v)
    }

    /// Durable audit's cost over group commit (both with policies off): requests/s durable
    /// over group, and the added p50 and p99. There is no target without audit: the gateway
    /// never serves a request it has not recorded (I5).
    fn durable_audit(&self) -> Option<Value> {
        let (durable, group) = (Kind::BulkheadDurable, Kind::Bulkhead);
        Some(json!({
            "rps_durable_vs_group": self.paired(durable, group, |a, b| a.rps / b.rps)?,
            "added_p50_us": self.paired(durable, group, |a, b| a.p50_us - b.p50_us)?,
            "added_p99_us": self.paired(durable, group, |a, b| a.p99_us - b.p99_us)?,
        }))
    }

    /// The stack's floor: the pass-through's requests/s over nginx's (what the serving stack
    /// costs), and the gateway's (policies off) requests/s over the floor's and CPU per
    /// request above it (what the gateway's own work costs).
    fn floor(&self) -> Option<Value> {
        let (gateway, floor) = (Kind::Bulkhead, Kind::PassThrough);
        let mut v = json!({
            "gateway_rps_vs_floor": self.paired(gateway, floor, |a, b| a.rps / b.rps)?,
        });
        if let Some(r) = self.paired(floor, Kind::Nginx, |a, b| a.rps / b.rps) {
            v["floor_rps_vs_nginx"] = json!(r);
        }
        if let Some(cpu) = self.paired_where(gateway, floor, |a, b| Some(a.cpu_us? - b.cpu_us?)) {
            v["gateway_added_cpu_us_per_request"] = json!(cpu);
        }
        Some(v)
    }

    /// The issues' goals, where measured: the gateway (policies off) within 10% of nginx's
    /// requests/s; the policy chain costing under 5% of the gateway's requests/s. None under
    /// paced load, where every target answers the rate it is offered.
    fn goals(&self) -> Map<String, Value> {
        let mut goals = Map::new();
        if self.paced {
            return goals;
        }
        let ratio = |a, b| self.paired(a, b, |x, y| x.rps / y.rps);
        if let Some(r) = ratio(Kind::Bulkhead, Kind::Nginx) {
            goals.insert("within_10pct_of_nginx".into(), json!(r >= 0.9));
        }
        if let Some(r) = ratio(Kind::BulkheadPolicies, Kind::Bulkhead) {
            goals.insert("policy_chain_under_5pct".into(), json!(r > 0.95));
        }
        goals
    }

    /// The JSON report: `settings` (how it was run), then per target its medians, its latency
    /// added over the direct baseline, and its ratios to nginx and LiteLLM; the skipped
    /// targets; the policy chain's cost.
    pub fn to_json(&self, settings: Map<String, Value>) -> Value {
        let mut out = settings;
        let mut targets = Map::new();
        for (kind, runs) in &self.measured {
            let column = |f: fn(&Figures) -> f64| median(runs.iter().map(f).collect());
            let mut t = Map::new();
            t.insert("rps".into(), json!(column(|f| f.rps)));
            t.insert("p50_us".into(), json!(column(|f| f.p50_us)));
            t.insert("p99_us".into(), json!(column(|f| f.p99_us)));
            if let Some(cpu) = self.cpu_us(*kind) {
                t.insert("cpu_us_per_request".into(), json!(cpu));
            }
            t.insert(
                "requests".into(),
                json!(runs.iter().map(|f| f.requests).sum::<usize>()),
            );
            t.insert(
                "errors".into(),
                json!(runs.iter().map(|f| f.errors).sum::<u64>()),
            );
            if let Some(added) = self.paired(*kind, Kind::Direct, |a, b| a.p50_us - b.p50_us) {
                t.insert("added_p50_us".into(), json!(added));
            }
            if let Some(added) = self.paired(*kind, Kind::Direct, |a, b| a.p99_us - b.p99_us) {
                t.insert("added_p99_us".into(), json!(added));
            }
            for peer in [Kind::Nginx, Kind::Litellm] {
                if let Some(v) = self.vs(*kind, peer).filter(|_| *kind != peer) {
                    t.insert(format!("vs_{}", peer.key()), v);
                }
            }
            targets.insert(kind.key().into(), Value::Object(t));
        }
        out.insert("targets".into(), Value::Object(targets));
        let skipped: Map<String, Value> = self
            .skipped
            .iter()
            .map(|(k, why)| (k.key().to_owned(), json!(why)))
            .collect();
        out.insert("skipped".into(), Value::Object(skipped));
        if let Some(chain) = self.policy_chain() {
            out.insert("policy_chain".into(), chain);
        }
        if let Some(audit) = self.durable_audit() {
            out.insert("durable_audit".into(), audit);
        }
        if let Some(floor) = self.floor() {
            out.insert("floor".into(), floor);
        }
        out.insert("goals".into(), Value::Object(self.goals()));
        Value::Object(out)
    }

    /// The table: one row per target (medians), then the skipped ones and the chain's cost.
    pub fn table(&self) -> String {
        let mut out = format!(
            "{:<24} {:>9} {:>9} {:>9} {:>10} {:>14} {:>16} {:>12} {:>12} {:>7}\n",
            "target",
            "req/s",
            "p50 µs",
            "p99 µs",
            "+p50 µs",
            "req/s ÷ nginx",
            "req/s ÷ LiteLLM",
            "CPU µs/req",
            "CPU ÷ nginx",
            "errors"
        );
        let num = |v: Option<f64>, digits: usize| {
            v.map_or_else(|| "—".to_owned(), |v| format!("{v:.digits$}"))
        };
        for kind in Kind::ALL {
            if let Some(runs) = self.runs(kind) {
                let column = |f: fn(&Figures) -> f64| median(runs.iter().map(f).collect());
                let ratio = |peer| {
                    (kind != peer)
                        .then(|| self.paired(kind, peer, |a, b| a.rps / b.rps))
                        .flatten()
                };
                out.push_str(&format!(
                    "{:<24} {:>9.0} {:>9.0} {:>9.0} {:>10} {:>14} {:>16} {:>12} {:>12} {:>7}\n",
                    kind.label(),
                    column(|f| f.rps),
                    column(|f| f.p50_us),
                    column(|f| f.p99_us),
                    num(
                        self.paired(kind, Kind::Direct, |a, b| a.p50_us - b.p50_us),
                        0
                    ),
                    num(ratio(Kind::Nginx), 2),
                    num(ratio(Kind::Litellm), 2),
                    num(self.cpu_us(kind), 0),
                    num(
                        (kind != Kind::Nginx)
                            .then(|| self.cpu_ratio(kind, Kind::Nginx))
                            .flatten(),
                        2
                    ),
                    runs.iter().map(|f| f.errors).sum::<u64>(),
                ));
            }
        }
        for (kind, why) in &self.skipped {
            out.push_str(&format!("{:<24} skipped: {why}\n", kind.label()));
        }
        if let Some(chain) = self.policy_chain() {
            out.push_str(&format!(
                "policy chain: req/s on ÷ off {:.3}, added p50 {:.0} µs, added p99 {:.0} µs, added CPU {} µs/req\n",
                chain["rps_on_vs_off"].as_f64().unwrap_or(f64::NAN),
                chain["added_p50_us"].as_f64().unwrap_or(f64::NAN),
                chain["added_p99_us"].as_f64().unwrap_or(f64::NAN),
                num(chain["added_cpu_us_per_request"].as_f64(), 0),
            ));
        }
        if let Some(audit) = self.durable_audit() {
            out.push_str(&format!(
                "durable audit: req/s durable ÷ group commit {:.3}, added p50 {:.0} µs, added p99 {:.0} µs\n",
                audit["rps_durable_vs_group"].as_f64().unwrap_or(f64::NAN),
                audit["added_p50_us"].as_f64().unwrap_or(f64::NAN),
                audit["added_p99_us"].as_f64().unwrap_or(f64::NAN),
            ));
        }
        if let Some(floor) = self.floor() {
            out.push_str(&format!(
                "floor: pass-through req/s ÷ nginx {}; gateway (policies off) req/s ÷ pass-through {:.3}, its own work {} CPU µs/req\n",
                num(floor["floor_rps_vs_nginx"].as_f64(), 3),
                floor["gateway_rps_vs_floor"].as_f64().unwrap_or(f64::NAN),
                num(floor["gateway_added_cpu_us_per_request"].as_f64(), 0),
            ));
        }
        for (goal, met) in self.goals() {
            out.push_str(&format!(
                "goal {goal}: {}\n",
                if met.as_bool() == Some(true) {
                    "met"
                } else {
                    "NOT met"
                }
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(rps: f64, p50_us: f64) -> Figures {
        Figures {
            rps,
            p50_us,
            p99_us: p50_us * 2.0,
            requests: rps as usize,
            errors: 0,
            // One core's worth of CPU at these rates.
            cpu_us: Some(1e6 / rps),
        }
    }

    fn results() -> Results {
        Results {
            measured: vec![
                (
                    Kind::Direct,
                    vec![f(1000.0, 100.0), f(500.0, 200.0), f(1000.0, 100.0)],
                ),
                (
                    Kind::Bulkhead,
                    vec![f(800.0, 150.0), f(400.0, 300.0), f(800.0, 150.0)],
                ),
                (
                    Kind::BulkheadPolicies,
                    vec![f(760.0, 170.0), f(380.0, 320.0), f(760.0, 170.0)],
                ),
                (
                    Kind::BulkheadDurable,
                    vec![f(600.0, 250.0), f(300.0, 500.0), f(600.0, 250.0)],
                ),
                (
                    Kind::PassThrough,
                    vec![f(1000.0, 110.0), f(500.0, 220.0), f(1000.0, 110.0)],
                ),
                (
                    Kind::Nginx,
                    vec![f(900.0, 120.0), f(450.0, 240.0), f(900.0, 120.0)],
                ),
            ],
            skipped: vec![(Kind::Litellm, "not installed".into())],
            paced: false,
        }
    }

    #[test]
    fn ratios_are_paired_per_run_so_a_slow_run_does_not_skew_them() {
        let json = results().to_json(Map::new());
        let off = &json["targets"]["bulkhead_policies_off"];
        // Run 2 is half as fast for everyone: every paired ratio is still 800/900.
        let r = off["vs_nginx"]["rps_ratio"].as_f64().expect("a ratio");
        assert!((r - 800.0 / 900.0).abs() < 1e-9, "{r}");
        assert_eq!(off["added_p50_us"], 50.0);
        assert_eq!(off["rps"], 800.0);
        let cpu = off["vs_nginx"]["cpu_per_request_ratio"]
            .as_f64()
            .expect("a CPU ratio");
        assert!((cpu - 900.0 / 800.0).abs() < 1e-9, "{cpu}");
        let chain = &json["policy_chain"];
        assert!((chain["rps_on_vs_off"].as_f64().expect("ratio") - 0.95).abs() < 1e-9);
        let added = chain["added_cpu_us_per_request"]
            .as_f64()
            .expect("added CPU");
        assert!(
            (added - (1e6 / 760.0 - 1e6 / 800.0)).abs() < 1e-6,
            "{added}"
        );
        assert_eq!(chain["added_p50_us"], 20.0);
        let audit = &json["durable_audit"];
        assert!((audit["rps_durable_vs_group"].as_f64().expect("ratio") - 0.75).abs() < 1e-9);
        assert_eq!(audit["added_p50_us"], 100.0);
        assert!(
            results()
                .table()
                .contains("durable audit: req/s durable ÷ group commit 0.750")
        );
        assert_eq!(
            json["goals"]["within_10pct_of_nginx"], false,
            "0.89 of nginx"
        );
        assert_eq!(
            json["goals"]["policy_chain_under_5pct"], false,
            "a cost of exactly 5% is not under 5%"
        );
    }

    /// Runs whose ratios, their medians' ratio and any other pairing of runs all differ:
    /// paired 800/900, 300/600, 700/1000 → 0.7; the medians' ratio 700/900; run i against
    /// run i+1 800/600, 300/1000, 700/900.
    #[test]
    fn a_ratio_is_the_median_of_each_runs_own_ratio() {
        let mut results = results();
        for (kind, runs) in &mut results.measured {
            match kind {
                Kind::Bulkhead => *runs = vec![f(800.0, 150.0), f(300.0, 150.0), f(700.0, 150.0)],
                Kind::Nginx => *runs = vec![f(900.0, 120.0), f(600.0, 120.0), f(1000.0, 120.0)],
                _ => {}
            }
        }
        let json = results.to_json(Map::new());
        let r = json["targets"]["bulkhead_policies_off"]["vs_nginx"]["rps_ratio"]
            .as_f64()
            .expect("a ratio");
        assert!((r - 0.7).abs() < 1e-9, "{r}");
        // Two runs: the mean of their ratios.
        for (kind, runs) in &mut results.measured {
            runs.truncate(2);
            if *kind == Kind::Bulkhead {
                runs[1] = f(450.0, 150.0);
            }
        }
        let json = results.to_json(Map::new());
        let r = json["targets"]["bulkhead_policies_off"]["vs_nginx"]["rps_ratio"]
            .as_f64()
            .expect("a ratio");
        assert!(
            (r - (800.0 / 900.0 + 450.0 / 600.0) / 2.0).abs() < 1e-9,
            "{r}"
        );
    }

    #[test]
    fn the_floor_splits_the_gap_to_nginx_into_the_stack_and_the_gateways_own_work() {
        let json = results().to_json(Map::new());
        let floor = &json["floor"];
        let r = floor["floor_rps_vs_nginx"].as_f64().expect("a ratio");
        assert!((r - 1000.0 / 900.0).abs() < 1e-9, "{r}");
        let r = floor["gateway_rps_vs_floor"].as_f64().expect("a ratio");
        assert!((r - 0.8).abs() < 1e-9, "{r}");
        let own = floor["gateway_added_cpu_us_per_request"]
            .as_f64()
            .expect("added CPU");
        assert!((own - (1e6 / 800.0 - 1e6 / 1000.0)).abs() < 1e-6, "{own}");
        let table = results().table();
        assert!(
            table.contains("floor: pass-through req/s ÷ nginx 1.111; gateway (policies off) req/s ÷ pass-through 0.800, its own work 250 CPU µs/req"),
            "{table}"
        );
        let mut r = results();
        r.measured.retain(|(k, _)| *k != Kind::PassThrough);
        assert!(r.to_json(Map::new()).get("floor").is_none());
    }

    #[test]
    fn runs_without_a_cpu_figure_are_left_out_of_the_cpu_columns_only() {
        let mut r = results();
        for (_, runs) in &mut r.measured {
            runs[0].cpu_us = None;
            runs[1].cpu_us = None;
        }
        let json = r.to_json(Map::new());
        let off = &json["targets"]["bulkhead_policies_off"];
        assert_eq!(off["cpu_us_per_request"], 1e6 / 800.0, "run 3 alone");
        assert_eq!(off["rps"], 800.0, "every run still counts for req/s");
        for (_, runs) in &mut r.measured {
            runs[2].cpu_us = None;
        }
        let json = r.to_json(Map::new());
        assert!(json["targets"]["nginx"].get("cpu_us_per_request").is_none());
        assert!(
            json["policy_chain"]
                .get("added_cpu_us_per_request")
                .is_none()
        );
    }

    #[test]
    fn under_paced_load_no_throughput_goal_is_judged() {
        let mut paced = results();
        // Every target answered the rate it was offered.
        for (_, runs) in &mut paced.measured {
            for f in runs {
                f.rps = 1000.0;
            }
        }
        assert_eq!(
            paced.to_json(Map::new())["goals"]["policy_chain_under_5pct"],
            true,
            "judged closed-loop, equal rates would pass"
        );
        paced.paced = true;
        let json = paced.to_json(Map::new());
        assert_eq!(json["goals"], json!({}));
        assert!(!paced.table().contains("goal "), "{}", paced.table());
        // The CPU per request still compares the targets.
        assert!(json["policy_chain"]["added_cpu_us_per_request"].is_f64());
    }

    #[test]
    fn skipped_peers_are_named_with_their_reason_and_have_no_ratios() {
        let json = results().to_json(Map::new());
        assert_eq!(json["skipped"]["litellm"], "not installed");
        assert!(json["targets"].get("litellm").is_none());
        assert!(
            json["targets"]["bulkhead_policies_on"]
                .get("vs_litellm")
                .is_none()
        );
        assert!(json["targets"]["nginx"].get("vs_nginx").is_none());
        let table = results().table();
        assert!(
            table.contains("litellm                  skipped: not installed"),
            "{table}"
        );
        assert!(
            table.contains("policy chain: req/s on ÷ off 0.950"),
            "{table}"
        );
    }
}
