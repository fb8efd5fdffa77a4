//! The tables the build script generates from the bindings, checked against the bindings it used
//! (generated from the installed headers, or the committed CUDA 13.0 ones): every `CUresult`
//! constant has its name, and every function the table declares is a function of the bindings.

use cudrv_sys::{CUresult, Driver, result_description, result_name};

const COMMITTED: &str = include_str!(concat!(env!("OUT_DIR"), "/bindings.rs"));

/// `(name, value)` of every `CUresult` constant in the committed bindings, however rustfmt
/// wrapped its line.
fn result_constants() -> Vec<(String, u32)> {
    let flat: String = COMMITTED.split_whitespace().collect();
    let mut out = Vec::new();
    let mut rest = flat.as_str();
    while let Some(at) = rest.find("pubconstCUDA_") {
        rest = &rest[at + "pubconst".len()..];
        let Some((name, tail)) = rest.split_once(":cudaError_enum=cudaError_enum(") else { continue };
        if name.contains(';') {
            continue;
        }
        let value = tail.split(')').next().unwrap().trim_end_matches(',');
        out.push((name.to_string(), value.parse().expect("a numeric CUresult")));
    }
    out
}

#[test]
fn every_result_code_of_the_bindings_is_named() {
    let constants = result_constants();
    assert!(constants.len() > 50, "found only {} CUresult constants", constants.len());
    for (name, value) in &constants {
        let named = result_name(CUresult(*value)).unwrap_or_else(|| panic!("{name} ({value}) has no name"));
        // Aliases share a value: the table names the first.
        assert!(named.starts_with("CUDA_"), "{value}: {named}");
    }
    // Constants that rustfmt wraps over three lines (their names are long).
    assert_eq!(
        result_name(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED),
        Some("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
    );
    assert_eq!(
        result_name(CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED),
        Some("CUDA_ERROR_STREAM_CAPTURE_INVALIDATED")
    );
    assert_eq!(result_name(CUresult(123_456)), None);
}

#[test]
fn descriptions_cover_the_common_codes() {
    assert_eq!(result_description(CUresult::CUDA_ERROR_OUT_OF_MEMORY), Some("out of memory"));
    assert_eq!(result_description(CUresult::CUDA_ERROR_NOT_SUPPORTED), Some("operation not supported"));
    assert_eq!(result_description(CUresult(123_456)), None);
}

#[test]
fn the_function_table_matches_the_bindings() {
    let functions = Driver::functions();
    assert!(functions.len() > 400, "only {} functions", functions.len());
    let flat: String = COMMITTED.split_whitespace().collect();
    for f in functions {
        if !flat.contains(&format!("pubfn{}(", f.name)) {
            // An older ABI of a function the bindings declare in a newer one (the safe crate
            // falls back to it on old drivers): never what cuGetProcAddress serves. cuda.h maps
            // cuGraphInstantiate to cuGraphInstantiateWithFlags, its successor.
            let base = f.base.to_str().unwrap();
            let successor = match base {
                "cuGraphInstantiate" => flat.contains("pubfncuGraphInstantiateWithFlags("),
                _ => (2..10).any(|v| flat.contains(&format!("pubfn{base}_v{v}("))),
            };
            assert!(!f.by_proc_address && successor, "{} is not a function of the bindings", f.name);
        }
        assert_eq!(f.cname.to_str().unwrap(), f.name);
        let base = f.base.to_str().unwrap();
        assert!(f.name.starts_with(base), "{}: base {base}", f.name);
        assert_eq!(f.versioned, f.name != base, "{}", f.name);
    }
    // Exactly one declaration per base name is the one cuGetProcAddress serves.
    let mut bases = std::collections::BTreeMap::<&str, usize>::new();
    for f in functions.iter().filter(|f| f.by_proc_address) {
        *bases.entry(f.base.to_str().unwrap()).or_default() += 1;
    }
    assert!(bases.values().all(|&n| n == 1), "{bases:?}");
    let alloc: Vec<&str> = functions.iter().filter(|f| f.base.to_str() == Ok("cuMemAlloc")).map(|f| f.name).collect();
    assert_eq!(alloc, ["cuMemAlloc_v2"], "the bindings declare cuMemAlloc as its _v2 ABI");
    let newest = functions.iter().find(|f| f.name == "cuMemAlloc_v2").unwrap();
    assert!(newest.by_proc_address && newest.versioned);
}
