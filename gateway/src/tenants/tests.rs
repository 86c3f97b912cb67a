//! The reload's invariants (see the module doc), through the same parser, the auth layer and
//! the limiter that serve requests.

use std::convert::Infallible;
use std::path::PathBuf;

use axum::body::Body;
use axum::response::Response;
use futures_util::FutureExt as _;
use http::{Request, StatusCode};
use tower::{Layer as _, service_fn};

use super::*;
use crate::auth::{AuthLayer, Authenticated};
use crate::keys::KeyHash;
use crate::limits::LimitError;
use crate::metrics::Metrics;
use crate::scratch::Scratch;
use crate::tenant::TenantId;

/// The scratch configuration file in `dir`.
fn config_path(dir: &Scratch) -> PathBuf {
    dir.0.join("gateway.toml")
}

/// Writes the scratch configuration file.
fn write(dir: &Scratch, text: &str) {
    std::fs::write(config_path(dir), text).expect("writes the config");
}

/// A tenant with `keys`, `concurrent` requests at once and `rpm` requests per minute.
fn tenant(id: &str, keys: &[&str], concurrent: u32, rpm: u32) -> String {
    let keys: Vec<String> = keys
        .iter()
        .map(|k| format!("\"{}\"", KeyHash::of(k).to_hex()))
        .collect();
    format!(
        "[[tenants]]\nid = \"{id}\"\nkey_sha256 = [{}]\nmax_context = 2048\n\
         max_concurrent = {concurrent}\nrequests_per_minute = {rpm}\ntokens_per_minute = 100000\n",
        keys.join(", ")
    )
}

const WORKER: &str = "[[workers]]\nname = \"w\"\ngrpc = \"127.0.0.1:50051\"\nrole = \"both\"\n";

/// A whole configuration: `head` (sections before the tenants), the tenants, one worker.
fn config(head: &str, tenants: &str) -> String {
    format!(
        "[listen]\napi = \"127.0.0.1:8080\"\nadmin = \"127.0.0.1:9090\"\n\
         [admin]\ntoken_sha256 = \"{}\"\n{head}\n{tenants}\n{WORKER}",
        KeyHash::of("admin").to_hex()
    )
}

/// Tenants started from `text`, written to a scratch file that reloads read.
fn start(text: &str) -> (Scratch, Tenants) {
    let scratch = Scratch::new("tenants");
    write(&scratch, text);
    let (config, file) = ConfigFile::load(&config_path(&scratch)).expect("a valid configuration");
    (
        scratch,
        Tenants::new(config.tenants, Limiter::default(), Some(file)),
    )
}

/// The auth layer on `tenants` around a handler that answers 200 with the tenant it saw.
fn auth(
    tenants: &Tenants,
) -> impl tower::Service<Request<Body>, Response = Response, Error = Infallible> + Clone {
    AuthLayer::new(tenants.clone(), Metrics::default()).layer(service_fn(
        |request: Request<Body>| async move {
            let who = request
                .extensions()
                .get::<Authenticated>()
                .map(|a| a.tenant.id.to_string())
                .unwrap_or_default();
            Ok::<_, Infallible>(Response::new(Body::from(who)))
        },
    ))
}

/// One request with `key` through `service`: its status and the tenant the handler saw.
fn call<S>(service: &S, key: &str) -> (StatusCode, String)
where
    S: tower::Service<Request<Body>, Response = Response, Error = Infallible> + Clone,
{
    let request = Request::builder()
        .header("authorization", format!("Bearer {key}"))
        .body(Body::empty())
        .expect("a request");
    let response = service
        .clone()
        .call(request)
        .now_or_never()
        .expect("answers at once")
        .expect("infallible");
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), 1024)
        .now_or_never()
        .expect("a ready body")
        .expect("a body");
    (status, String::from_utf8_lossy(&body).into_owned())
}

fn id(s: &str) -> TenantId {
    TenantId::new(s).expect("valid")
}

#[test]
fn a_file_that_does_not_validate_changes_nothing_and_says_why() {
    let good = config("", &tenant("tenant-a", &["sk-a"], 2, 60));
    let (scratch, tenants) = start(&good);
    let service = auth(&tenants);
    let before = tenants.current();
    for (bad, reason) in [
        (
            config(
                "",
                &(tenant("tenant-a", &["sk-x"], 2, 60) + &tenant("tenant-b", &["sk-x"], 2, 60)),
            ),
            "also a key of tenant",
        ),
        (
            config(
                "",
                &(tenant("tenant-a", &["sk-x"], 2, 60) + &tenant("tenant-a", &["sk-y"], 2, 60)),
            ),
            "defined twice",
        ),
        (good.replace("[[tenants]]", "[[tenants]"), "line"),
        (
            good.replace("max_concurrent = 2", "max_concurrent = 0"),
            "max_concurrent must be at least 1",
        ),
        (config("", ""), "no tenants"),
    ] {
        write(&scratch, &bad);
        let err = tenants.reload().expect_err("refused");
        assert!(matches!(err, ReloadError::Invalid(_)), "{err:?}");
        let said = err.to_string();
        assert!(said.contains(reason), "{said}");
        assert!(
            Arc::ptr_eq(&before, &tenants.current()),
            "the running set stays"
        );
        assert_eq!(call(&service, "sk-a"), (StatusCode::OK, "tenant-a".into()));
        assert_eq!(call(&service, "sk-x").0, StatusCode::UNAUTHORIZED);
        assert_eq!(tenants.last_error().as_deref(), Some(said.as_str()));
        assert_eq!(tenants.status()["last_reload_error"], said.as_str());
    }
    std::fs::remove_file(config_path(&scratch)).expect("removes the file");
    assert!(matches!(tenants.reload(), Err(ReloadError::Invalid(_))));
    assert!(Arc::ptr_eq(&before, &tenants.current()));
    // A FIFO no one writes to: refused at once, where reading it would wait forever.
    let fifo =
        std::ffi::CString::new(config_path(&scratch).to_str().expect("UTF-8")).expect("no NUL");
    // SAFETY: `fifo` is a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    let err = tenants.reload().expect_err("refused");
    assert!(err.to_string().contains("not a regular file"), "{err}");
    std::fs::remove_file(config_path(&scratch)).expect("removes the FIFO");
    write(&scratch, &good);
    tenants.reload().expect("a good file again");
    assert_eq!(tenants.last_error(), None, "a good reload clears the error");
}

#[test]
fn a_removed_tenant_or_a_rotated_key_is_refused_from_the_next_request_on() {
    let (scratch, tenants) = start(&config(
        "",
        &(tenant("tenant-a", &["sk-a", "sk-a2"], 2, 60) + &tenant("tenant-b", &["sk-b"], 2, 60)),
    ));
    let service = auth(&tenants);
    assert_eq!(call(&service, "sk-b"), (StatusCode::OK, "tenant-b".into()));
    assert_eq!(call(&service, "sk-c").0, StatusCode::UNAUTHORIZED);
    // A request of tenant-b in flight across the reload: authenticated, holding its slot.
    let in_flight = tenants
        .current()
        .keyring()
        .tenant(&KeyHash::of("sk-b"))
        .expect("b's key")
        .clone();
    let permit = tenants.limiter().start(&in_flight).expect("b's slot");

    // tenant-b removed; tenant-a's sk-a rotated away for sk-a3; tenant-c new.
    write(
        &scratch,
        &config(
            "",
            &(tenant("tenant-a", &["sk-a2", "sk-a3"], 2, 60)
                + &tenant("tenant-c", &["sk-c"], 1, 60)),
        ),
    );
    let reloaded = tenants.reload().expect("valid");
    assert_eq!(
        reloaded,
        Reloaded {
            added: vec![id("tenant-c")],
            removed: vec![id("tenant-b")],
            changed: vec![id("tenant-a")],
            restart_required: vec![],
            reused: vec![],
            renamed: vec![],
        }
    );
    assert_eq!(call(&service, "sk-b").0, StatusCode::UNAUTHORIZED);
    assert_eq!(call(&service, "sk-a").0, StatusCode::UNAUTHORIZED);
    assert_eq!(call(&service, "sk-a2"), (StatusCode::OK, "tenant-a".into()));
    assert_eq!(call(&service, "sk-a3"), (StatusCode::OK, "tenant-a".into()));
    assert_eq!(
        call(&service, "sk-c"),
        (StatusCode::OK, "tenant-c".into()),
        "a new tenant works at once"
    );
    let c = tenants
        .current()
        .get(&id("tenant-c"))
        .expect("tenant-c")
        .clone();
    let _c = tenants.limiter().start(&c).expect("c's own budget");
    assert!(tenants.limiter().start(&c).is_err(), "c's limit: 1 at once");

    // The request in flight finishes on what it started with, and gives its slot back.
    assert_eq!(in_flight.id.as_str(), "tenant-b");
    assert_eq!(tenants.limiter().in_flight(&in_flight.id), 1);
    drop(permit);
    assert_eq!(tenants.limiter().in_flight(&in_flight.id), 0);
}

#[test]
fn the_limiter_keeps_in_flight_counts_and_the_minutes_usage_across_a_reload() {
    let text = |concurrent, rpm| config("", &tenant("tenant-a", &["sk-a"], concurrent, rpm));
    let (scratch, tenants) = start(&text(2, 5));
    let a = || {
        tenants
            .current()
            .get(&id("tenant-a"))
            .expect("tenant-a")
            .clone()
    };
    let limiter = tenants.limiter().clone();
    let held = limiter.start(&a()).expect("1 of 5");
    drop(limiter.start(&a()).expect("2 of 5"));

    // The same file again resets nothing: one in flight, two of the minute's five used.
    tenants.reload().expect("unchanged");
    let second = limiter.start(&a()).expect("2 in flight, 3 of 5");
    assert!(
        matches!(
            limiter.start(&a()),
            Err(LimitError::Concurrency { limit: 2, .. })
        ),
        "the in-flight count survived the reload"
    );
    drop(second);

    // Lowered: the new limits apply to the next request, against the kept counts.
    write(&scratch, &text(1, 3));
    let reloaded = tenants.reload().expect("valid");
    assert_eq!(reloaded.changed, vec![id("tenant-a")]);
    assert_eq!(a().limits.max_concurrent.get(), 1);
    assert!(matches!(
        limiter.start(&a()),
        Err(LimitError::Concurrency { limit: 1, .. })
    ));
    drop(held);
    assert!(
        matches!(
            limiter.start(&a()),
            Err(LimitError::RequestsPerMinute { limit: 3, .. })
        ),
        "3 of the new 3 per minute already used: no burst from a reload"
    );

    // Raised again: the same usage, against the larger limit.
    write(&scratch, &text(2, 5));
    tenants.reload().expect("valid");
    let fourth = limiter.start(&a()).expect("4 of 5");
    drop(fourth);
    drop(limiter.start(&a()).expect("5 of 5"));
    assert!(matches!(
        limiter.start(&a()),
        Err(LimitError::RequestsPerMinute { limit: 5, .. })
    ));
}

#[test]
fn a_tenant_renamed_with_its_keys_keeps_its_budget_under_the_new_id() {
    let (scratch, tenants) = start(&config(
        "",
        &(tenant("tenant-a", &["sk-a", "sk-a2"], 1, 2) + &tenant("tenant-c", &["sk-c"], 1, 2)),
    ));
    let limiter = tenants.limiter().clone();
    let of = |name: &str| tenants.current().get(&id(name)).expect("listed").clone();
    let before = of("tenant-a");
    let held = limiter.start(&before).expect("1 of 2");
    // Renamed, its keys kept (one moved to a tenant that stays: no rename of that one).
    write(
        &scratch,
        &config(
            "",
            &(tenant("tenant-b", &["sk-a"], 1, 2) + &tenant("tenant-c", &["sk-c", "sk-a2"], 1, 2)),
        ),
    );
    let reloaded = tenants.reload().expect("valid");
    assert_eq!(reloaded.renamed, vec![(id("tenant-a"), id("tenant-b"))]);
    // Its request in flight is the new id's: no second one at once.
    assert!(matches!(
        limiter.start(&of("tenant-b")),
        Err(LimitError::Concurrency { limit: 1, .. })
    ));
    assert_eq!(limiter.in_flight(&id("tenant-b")), 1);
    // Nor under the old id, for a request authenticated before the reload (or one that reads
    // its rate limits as it ends): the same budget, not a fresh one.
    assert!(matches!(
        limiter.start(&before),
        Err(LimitError::Concurrency { limit: 1, .. })
    ));
    // Ended under the new name, it frees the new id's slot; the minute's usage came along.
    drop(held);
    assert_eq!(limiter.in_flight(&id("tenant-b")), 0);
    drop(limiter.start(&of("tenant-b")).expect("2 of 2"));
    assert!(matches!(
        limiter.start(&of("tenant-b")),
        Err(LimitError::RequestsPerMinute { limit: 2, .. })
    ));
    // The tenant that only gained a key keeps its own budget.
    drop(limiter.start(&of("tenant-c")).expect("its own 1 of 2"));
}

/// Tenant `tenant-a` allowed `concurrent` requests at once, as authenticated then; and a reload
/// to another number.
fn tenant_a_reloadable(concurrent: u32) -> (impl Fn(u32), Tenants, Arc<crate::tenant::Tenant>) {
    let text = |concurrent| config("", &tenant("tenant-a", &["sk-a"], concurrent, 60));
    let (scratch, tenants) = start(&text(concurrent));
    let before = tenants
        .current()
        .get(&id("tenant-a"))
        .expect("tenant-a")
        .clone();
    let reloading = tenants.clone();
    let reload = move |concurrent| {
        write(&scratch, &text(concurrent));
        reloading.reload().expect("valid");
    };
    (reload, tenants, before)
}

#[test]
fn a_request_authenticated_before_a_reload_gets_the_new_limits_at_its_first_start() {
    // A tenant that had sent nothing yet had no budget; its request authenticated against the
    // old set, a reload lowered the tenant's limits, then the request started: the budget it
    // made came from the old set's limits, and the lowered ones were ignored.
    let (reload, tenants, before) = tenant_a_reloadable(3);
    reload(1);
    let limiter = tenants.limiter();
    let first = limiter.start(&before).expect("1 of 1");
    assert!(
        matches!(
            limiter.start(&before),
            Err(LimitError::Concurrency { limit: 1, .. })
        ),
        "the reloaded limit applies"
    );
    drop(first);
}

/// A request started before a reload reads the reloaded limits when it is admitted (its
/// context, its default max tokens), as its budget does: it kept the limits of its
/// authentication, so an emergency lowering missed every request whose body was still coming.
#[test]
fn a_request_started_before_a_reload_is_admitted_under_the_new_limits() {
    let (reload, tenants, before) = tenant_a_reloadable(3);
    let permit = tenants.limiter().start(&before).expect("1 of 3");
    assert_eq!(permit.limits().max_concurrent.get(), 3);
    reload(2);
    assert_eq!(
        permit.limits().max_concurrent.get(),
        2,
        "the reloaded limits"
    );
    assert_eq!(
        before.limits.max_concurrent.get(),
        3,
        "what it authenticated with"
    );
}

#[test]
fn a_reload_that_gives_a_tenant_the_running_admin_token_is_refused() {
    // The file's own admin token changed (applied only at a restart) and a tenant got the
    // running one as its key: reloaded, that key would open the admin listener.
    let (scratch, tenants) = start(&config("", &tenant("tenant-a", &["sk-a"], 2, 60)));
    // The [admin] line comes first: only it changes; the tenant's new key is "admin".
    let moved = config("", &tenant("tenant-a", &["sk-a", "admin"], 2, 60)).replacen(
        &KeyHash::of("admin").to_hex(),
        &KeyHash::of("admin-2").to_hex(),
        1,
    );
    assert!(
        moved.contains(&KeyHash::of("admin").to_hex()),
        "the tenant's key stays"
    );
    write(&scratch, &moved);
    let err = tenants.reload().expect_err("refused");
    assert!(err.to_string().contains("admin"), "{err}");
    assert_eq!(call(&auth(&tenants), "admin").0, StatusCode::UNAUTHORIZED);
}

#[test]
fn workers_and_groups_listed_in_another_order_need_no_restart() {
    let tenants_a = tenant("tenant-a", &["sk-a"], 2, 60);
    let w2 = "[[workers]]\nname = \"w2\"\ngrpc = \"127.0.0.1:50052\"\nrole = \"both\"\n";
    let g = |name: &str| {
        format!(
            "[[worker_groups]]\nname = \"{name}\"\ndns = \"{name}.svc:50051\"\nrole = \"both\"\n"
        )
    };
    let (scratch, tenants) = start(&config(&format!("{w2}{}{}", g("g1"), g("g2")), &tenants_a));
    // w2 after w now, and the groups swapped.
    let swapped = config(&format!("{}{}", g("g2"), g("g1")), &tenants_a);
    write(&scratch, &format!("{swapped}{w2}"));
    assert_eq!(
        tenants.reload().expect("valid").restart_required,
        vec![],
        "the same workers and groups"
    );
    write(&scratch, &format!("{}{w2}", config(&g("g1"), &tenants_a)));
    assert_eq!(
        tenants.reload().expect("valid").restart_required,
        vec![Section::WorkerGroups],
        "a group less"
    );
}

#[test]
fn sections_that_need_a_restart_are_reported_and_not_applied() {
    let tenants_a = tenant("tenant-a", &["sk-a"], 2, 60);
    let (scratch, tenants) = start(&config("", &tenants_a));
    assert_eq!(
        tenants.reload().expect("unchanged").restart_required,
        vec![],
        "nothing differs"
    );

    let changed = config(
        "[http]\ndefault_max_tokens = 64\n[telemetry]\notlp_endpoint = \"http://127.0.0.1:4318\"\n",
        &tenant("tenant-a", &["sk-a2"], 2, 60),
    )
    .replace("127.0.0.1:8080", "127.0.0.1:8081")
    .replace("127.0.0.1:50051", "127.0.0.1:50052");
    write(&scratch, &changed);
    let reloaded = tenants.reload().expect("valid");
    assert_eq!(
        reloaded.restart_required,
        vec![
            Section::Listen,
            Section::Http,
            Section::Workers,
            Section::Telemetry
        ]
    );
    assert_eq!(
        reloaded.changed,
        vec![id("tenant-a")],
        "the tenants are applied all the same"
    );
    let service = auth(&tenants);
    assert_eq!(call(&service, "sk-a2").0, StatusCode::OK);
    // Not applied: the next reload still finds them different from what runs.
    let again = tenants.reload().expect("valid");
    assert_eq!(again.restart_required, reloaded.restart_required);
    assert_eq!(again.changed, vec![]);
    let names: Vec<_> = again.restart_required.iter().map(|s| s.name()).collect();
    assert_eq!(names, ["listen", "http", "workers", "telemetry"]);
}

#[test]
fn without_a_file_a_reload_is_refused_and_nothing_changes() {
    let config =
        crate::Config::parse(&config("", &tenant("tenant-a", &["sk-a"], 2, 60))).expect("valid");
    let tenants = Tenants::new(config.tenants, Limiter::default(), None);
    let before = tenants.current();
    assert!(matches!(tenants.reload(), Err(ReloadError::NoFile)));
    assert!(Arc::ptr_eq(&before, &tenants.current()));
}

/// SIGHUP without a file to read is a refused reload, not the signal's default action (which
/// ends the process: `bulkhead up` without `--config` died of it). nextest runs each test in a
/// process of its own, so the signal reaches this one only.
#[tokio::test]
async fn sighup_without_a_file_is_a_refused_reload_not_the_end_of_the_process() {
    let config =
        crate::Config::parse(&config("", &tenant("tenant-a", &["sk-a"], 2, 60))).expect("valid");
    let tenants = Tenants::new(config.tenants, Limiter::default(), None);
    let _listening = tenants.spawn_reload_on_hangup().expect("SIGHUP is heard");
    // SAFETY: raise only sends this process a signal, which tokio's handler now takes.
    assert_eq!(unsafe { libc::raise(libc::SIGHUP) }, 0);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while tenants.last_error().is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "the SIGHUP was not heard"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(tenants.status()["last_reload_error"].is_string());
}

#[test]
fn the_listing_names_key_ids_and_limits_never_keys_or_hashes() {
    let (_scratch, tenants) = start(&config(
        "",
        &(tenant("tenant-a", &["sk-a", "sk-a2"], 2, 60) + &tenant("tenant-b", &["sk-b"], 3, 7)),
    ));
    let status = tenants.status();
    let text = status.to_string();
    for key in ["sk-a", "sk-a2", "sk-b"] {
        assert!(!text.contains(key), "{text}");
        assert!(!text.contains(&KeyHash::of(key).to_hex()), "{text}");
    }
    let b = &status["tenants"][1];
    assert_eq!(b["id"], "tenant-b");
    assert_eq!(b["limits"]["max_concurrent"], 3);
    assert_eq!(b["limits"]["requests_per_minute"], 7);
    assert_eq!(b["in_flight"], 0);
    assert_eq!(
        status["tenants"][0]["key_ids"],
        serde_json::json!([
            KeyHash::of("sk-a").id().as_str(),
            KeyHash::of("sk-a2").id().as_str()
        ])
    );
}
