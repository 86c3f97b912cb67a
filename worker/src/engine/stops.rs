//! Stop sequences over streamed text: text that might be the start of a stop sequence is held
//! back until it is clear, and a completed stop sequence is never emitted.

/// The outcome of adding text.
#[derive(Debug, PartialEq, Eq)]
pub enum StopScan {
    /// Text safe to emit now; generation goes on.
    Continue(String),
    /// Generation ends at `stop`, one of the stop sequences; `text` is what to emit before it.
    Stopped { text: String, stop: String },
}

/// Watches a stream of text for a request's stop sequences.
#[derive(Debug, Default)]
pub struct StopWatch {
    stops: Vec<String>,
    held: String,
}

impl StopWatch {
    /// `stops` are non-empty strings (empty ones are ignored).
    pub fn new(stops: Vec<String>) -> StopWatch {
        StopWatch {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    pub fn push(&mut self, text: &str) -> StopScan {
        if self.stops.is_empty() {
            return StopScan::Continue(text.to_owned());
        }
        self.held.push_str(text);
        if let Some((at, stop)) = self
            .stops
            .iter()
            .filter_map(|s| Some((self.held.find(s.as_str())?, s)))
            .min_by_key(|&(at, _)| at)
        {
            let out = self.held[..at].to_owned();
            self.held.clear();
            return StopScan::Stopped {
                text: out,
                stop: stop.clone(),
            };
        }
        // Hold back the longest tail that is a proper prefix of some stop sequence.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(|&n| s.is_char_boundary(n))
                    .map(move |n| &s[..n])
            })
            .filter(|p| self.held.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_owned();
        self.held.drain(..cut);
        StopScan::Continue(out)
    }

    /// Text held back when the stream ends for another reason.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_split_across_tokens_is_never_emitted() {
        let mut w = StopWatch::new(vec!["END".into()]);
        assert_eq!(w.push("abc E"), StopScan::Continue("abc ".into()));
        assert_eq!(w.push("N"), StopScan::Continue(String::new()));
        assert_eq!(
            w.push("Dxyz"),
            StopScan::Stopped {
                text: String::new(),
                stop: "END".into()
            }
        );
    }

    #[test]
    fn a_false_start_is_released() {
        let mut w = StopWatch::new(vec!["END".into()]);
        assert_eq!(w.push("EN"), StopScan::Continue(String::new()));
        assert_eq!(w.push("o"), StopScan::Continue("ENo".into()));
        assert_eq!(w.push("E"), StopScan::Continue(String::new()));
        assert_eq!(w.finish(), "E");
    }

    #[test]
    fn the_earliest_stop_wins() {
        let mut w = StopWatch::new(vec!["b".into(), "a".into(), String::new()]);
        assert_eq!(
            w.push("xxabc"),
            StopScan::Stopped {
                text: "xx".into(),
                stop: "a".into()
            }
        );
    }
}
