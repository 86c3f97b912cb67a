//! Why a component cannot be a policy plugin, in its author's terms. wasmtime says what did
//! not link ("a matching implementation was not found in the linker"); an author needs to
//! hear that the plugin was built against another version of `wit/policy.wit`, imports what
//! no plugin is offered, or is not a component at all.

use wasmtime::Engine;
use wasmtime::component::Component;

use super::bindings::POLICY;

/// The contract's interfaces, as components name them (`bulkhead:policy/host@0.1.1`).
const PACKAGE: &str = "bulkhead:policy/";
/// What plugins built against a version this gateway links name their versions as.
const COMPATIBLE: &str = "0.1.";

/// The version of the contract this gateway offers (`wit/policy.wit`'s package line).
fn offered() -> &'static str {
    POLICY
        .rsplit_once('@')
        .map_or(POLICY, |(_, version)| version)
}

/// Imports a plugin may declare but is never given, and why.
const NOT_OFFERED: [(&str, &str); 1] = [("wasi:http/", "plugins get no network")];

/// Why `bytes` cannot be compiled as a component, when they are not WebAssembly at all or
/// a core WebAssembly module (a component's header has another version and layer).
pub(super) fn not_a_component(bytes: &[u8]) -> Option<&'static str> {
    if !bytes.starts_with(b"\0asm") {
        return Some(
            "it is not WebAssembly (the file does not begin with \\0asm): name the component \
             that its build wrote (a .wasm file)",
        );
    }
    (bytes.get(..8) == Some(b"\0asm\x01\0\0\0")).then_some(
        "it is a core WebAssembly module, not a component: build it for wasm32-wasip2, or \
         make it one with `wasm-tools component new` (plugins/README.md)",
    )
}

/// Why `component`, which did not link as a plugin, did not, when the reason is one of the
/// above; `None` leaves wasmtime's word for it.
pub(super) fn mismatch(engine: &Engine, component: &Component) -> Option<String> {
    let ty = component.component_type();
    let imports: Vec<&str> = ty.imports(engine).map(|(name, _)| name).collect();
    let exports: Vec<&str> = ty.exports(engine).map(|(name, _)| name).collect();
    if let Some(version) = imports
        .iter()
        .chain(&exports)
        .find_map(|n| foreign_version(n))
    {
        return Some(format!(
            "it was built against bulkhead:policy@{version}; this gateway offers \
             bulkhead:policy@{} (plugins built against {COMPATIBLE}x load): rebuild it \
             against this gateway's wit/",
            offered()
        ));
    }
    for name in &imports {
        if let Some((_, why)) = NOT_OFFERED.iter().find(|(p, _)| name.starts_with(p)) {
            return Some(format!(
                "it imports {name}, which the gateway does not offer ({why})"
            ));
        }
    }
    if !exports.iter().any(|n| n.starts_with(PACKAGE)) {
        return Some(format!(
            "it exports no {PACKAGE}policy interface: build it for the world `plugin` of \
             wit/policy.wit"
        ));
    }
    None
}

/// The version a name of the contract's interfaces carries, when it is not one this gateway
/// links.
fn foreign_version(name: &str) -> Option<&str> {
    let (_, version) = name.strip_prefix(PACKAGE)?.split_once('@')?;
    (!version.starts_with(COMPATIBLE)).then_some(version)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_names_of_the_contract_outside_0_1_are_foreign() {
        assert_eq!(foreign_version("bulkhead:policy/host@0.2.0"), Some("0.2.0"));
        assert_eq!(
            foreign_version("bulkhead:policy/policy@1.0.0"),
            Some("1.0.0")
        );
        assert_eq!(foreign_version("bulkhead:policy/host@0.1.0"), None);
        assert_eq!(foreign_version("bulkhead:policy/host@0.1.7"), None);
        assert_eq!(foreign_version("wasi:io/streams@0.2.0"), None);
        assert_eq!(foreign_version("bulkhead:policy/host"), None);
    }

    #[test]
    fn the_version_offered_is_compatible_with_itself() {
        assert!(offered().starts_with(COMPATIBLE), "{}", offered());
    }

    #[test]
    fn a_core_module_or_a_file_that_is_not_wasm_is_told_from_a_component() {
        let core = not_a_component(b"\0asm\x01\0\0\0rest").expect("a core module");
        assert!(core.contains("core WebAssembly module"), "{core}");
        assert!(not_a_component(b"\0asm\x0d\0\x01\0rest").is_none());
        assert!(not_a_component(b"\0asm").is_none());
        for text in [&b"#!/bin/sh\n"[..], b"", b"\0as"] {
            let no = not_a_component(text).expect("not WebAssembly");
            assert!(no.contains("not WebAssembly"), "{no}");
        }
    }
}
