//! A plugin built against `bulkhead:policy@0.1.0` (the frozen copy in `wit/` beside this
//! crate), before `host.gateway-version` existed. It denies requests that carry the header
//! `x-compat: deny` (418, so a test can tell it acted) and allows the rest.

wit_bindgen::generate!({ world: "plugin", path: "wit" });

use bulkhead::policy::types::{Denial, Directive, Disconnect, Hooks, Mutations, RequestView};
use bulkhead::policy::types::{ResponseEnd, Verdict};
use exports::bulkhead::policy::policy::Guest;

struct Compat;

impl Guest for Compat {
    fn configure(_: String) -> Result<Hooks, String> {
        Ok(Hooks::ON_REQUEST)
    }

    fn on_request(request: RequestView) -> Verdict {
        let deny = request
            .headers
            .iter()
            .any(|h| h.name == "x-compat" && h.value == "deny");
        if deny {
            bulkhead::policy::host::log(
                bulkhead::policy::types::Level::Info,
                "compat-0.1.0 denies this request",
            );
            Verdict::Deny(Denial {
                status: 418,
                message: "denied by a 0.1.0 plugin".into(),
            })
        } else {
            Verdict::Allow(Mutations {
                tags: Vec::new(),
                clamp_max_tokens: None,
                add_headers: Vec::new(),
            })
        }
    }

    fn on_disconnect(_: Disconnect) -> Directive {
        Directive::AbortNow
    }

    fn on_response_end(_: ResponseEnd) {}
}

export!(Compat);
