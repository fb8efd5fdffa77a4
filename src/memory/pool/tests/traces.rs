//! Every trace in `traces/` replayed on the simulator: within a budget of 1.10x its peak of live
//! bytes, and reserving at most 1.25x without a budget.

use crate::memory::{PoolConfig, Trace};

fn traces() -> Vec<(String, Trace)> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/traces");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("traces/ exists") {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "csv") {
            let text = std::fs::read_to_string(&path).unwrap();
            let trace = Trace::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            out.push((path.file_name().unwrap().to_string_lossy().into_owned(), trace));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(out.len() >= 5, "expected the traces of traces/");
    out
}

#[test]
#[cfg_attr(miri, ignore)]
fn every_trace_fits_in_110_percent_of_its_peak() {
    for (name, trace) in traces() {
        let budget = trace.peak_live() / 100 * 110;
        let r = trace.replay_simulated(PoolConfig::default(), Some(budget));
        assert_eq!(
            r.out_of_memory_at,
            None,
            "{name}: out of memory at event {:?} of {}",
            r.out_of_memory_at,
            trace.events().len()
        );
        eprintln!("{name}: budget 1.10: reserved/live {:.3}, {} driver allocs", r.ratio(), r.driver_allocs);
    }
}

#[test]
#[cfg_attr(miri, ignore)]
fn every_trace_reserves_at_most_125_percent_of_its_peak() {
    for (name, trace) in traces() {
        let r = trace.replay_simulated(PoolConfig::default(), None);
        eprintln!(
            "{name}: reserved/live {:.3}, {} driver allocs, {} frees",
            r.ratio(),
            r.driver_allocs,
            r.driver_frees
        );
        assert!(r.ratio() <= 1.25, "{name}: reserved/live {:.3}", r.ratio());
    }
}

/// A replay that shows the arena where a budgeted replay runs out of memory (run by hand:
/// `CUDRV_TRACE=decode_kvcache.csv CUDRV_BUDGET=1.10 cargo test --release --lib explain_oom -- --ignored --nocapture`).
#[test]
#[ignore]
fn explain_oom() {
    use super::super::sim::SimulatedPool;
    use crate::memory::TraceEvent;
    let want = std::env::var("CUDRV_TRACE").unwrap_or_default();
    let factor: f64 = std::env::var("CUDRV_BUDGET").ok().and_then(|v| v.parse().ok()).unwrap_or(1.10);
    for (name, trace) in traces() {
        if !want.is_empty() && name != want {
            continue;
        }
        let budget = (trace.peak_live() as f64 * factor) as usize;
        let mut config = PoolConfig::default();
        for kv in std::env::var("CUDRV_CONFIG").unwrap_or_default().split(',').filter(|s| !s.is_empty()) {
            let (k, v) = kv.split_once('=').unwrap();
            let n = || v.parse::<usize>().unwrap() << 20;
            match k {
                "medium_limit" => config.medium_limit = n(),
                "medium_chunk" => config.medium_chunk = n(),
                "small_chunk" => config.small_chunk = n(),
                "headroom" => config.headroom_percent = v.parse().ok(),
                _ => panic!("{k}"),
            }
        }
        let pool = SimulatedPool::new(config, Some(budget));
        let mut ptrs = std::collections::HashMap::new();
        let mut live = 0usize;
        for (i, ev) in trace.events().iter().enumerate() {
            match *ev {
                TraceEvent::Alloc { id, size, stream } => match pool.allocate(size, stream) {
                    Ok(p) => {
                        ptrs.insert(id, p);
                        live += size;
                    }
                    Err(e) => {
                        eprintln!("{name}: event {i}: alloc {size} on {stream} failed: {e}");
                        eprintln!("  live {live}, budget {budget}, stats {:?}", pool.stats());
                        eprintln!("{}", pool.describe());
                        break;
                    }
                },
                TraceEvent::Free { id, size, stream } => {
                    pool.deallocate(ptrs.remove(&id).unwrap(), size, stream).unwrap();
                    live -= size;
                }
            }
        }
    }
}
