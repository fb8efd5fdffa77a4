//! A tool for explaining where a budgeted trace replay runs out of memory (the trace budgets
//! themselves are checked by `tests/traces.rs`, with the public API, as are the tests that read
//! the traces: `traces/` is not in the published package, whose unit tests run in CI), and the
//! tests of a replay's table.

use crate::memory::{PoolConfig, Trace, TraceEvent};

/// The traces in `traces/`, by file name, in name order.
pub(super) fn traces() -> Vec<(String, Trace)> {
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
    out
}

/// A replay that shows the arena where a budgeted replay runs out of memory (run by hand:
/// `CUDRV_TRACE=decode_kvcache.csv CUDRV_BUDGET=1.10 cargo test --release --lib explain_oom -- --ignored --nocapture`).
/// `CUDRV_TRACE` may be a path (with a `/`) to a trace elsewhere; `CUDRV_BUDGET_EXTRA_MIB` adds
/// MiB to the budget (a GPU replay's budget is the factor's plus up to 2 MiB: whole pages);
/// `CUDRV_WARM` replays the trace whole first and explains the second replay.
#[test]
#[ignore]
fn explain_oom() {
    use super::super::sim::SimulatedPool;
    let want = std::env::var("CUDRV_TRACE").unwrap_or_default();
    let factor: f64 = std::env::var("CUDRV_BUDGET").ok().and_then(|v| v.parse().ok()).unwrap_or(1.10);
    // A path (with a '/') names a trace outside `traces/`.
    let all = if want.contains('/') {
        let text = std::fs::read_to_string(&want).unwrap();
        vec![(want.clone(), Trace::parse(&text).unwrap())]
    } else {
        traces()
    };
    let extra: usize = std::env::var("CUDRV_BUDGET_EXTRA_MIB").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    for (name, trace) in all {
        if !want.is_empty() && name != want {
            continue;
        }
        let budget = (trace.peak_live() as f64 * factor) as usize + (extra << 20);
        let mut config = PoolConfig::default();
        for kv in std::env::var("CUDRV_CONFIG").unwrap_or_default().split(',').filter(|s| !s.is_empty()) {
            let (k, v) = kv.split_once('=').unwrap();
            let n = || v.parse::<usize>().unwrap() << 20;
            match k {
                "medium_limit" => config.medium_limit = n(),
                "medium_chunk" => config.medium_chunk = n(),
                "small_chunk" => config.small_chunk = n(),
                "headroom" => config.headroom_percent = v.parse().ok(),
                "expandable" => config.expandable = v == "1",
                "reservoir" => config.reservoir = v == "1",
                _ => panic!("{k}"),
            }
        }
        eprintln!("{name}: budget {budget} ({:.4}x the peak live)", budget as f64 / trace.peak_live() as f64);
        let pool = SimulatedPool::new(config, Some(budget));
        if std::env::var_os("CUDRV_WARM").is_some() {
            // A warm replay: on the pool a whole (cold) replay left behind.
            trace.replay_on(&pool);
            eprintln!("{name}: after the cold replay {:?}\n{}", pool.stats(), pool.describe());
        }
        let mut table = trace.replay_table();
        for (i, ev) in trace.events().iter().enumerate() {
            match *ev {
                TraceEvent::Alloc { size, stream, .. } => match pool.allocate(size, stream) {
                    Ok(p) => table.allocated(i, p),
                    Err(e) => {
                        eprintln!("{name}: event {i}: alloc {size} on {stream} failed: {e}");
                        eprintln!("  live {}, budget {budget}, stats {:?}", table.live_bytes(), pool.stats());
                        eprintln!("{}", pool.describe());
                        break;
                    }
                },
                TraceEvent::Free { size, stream, .. } => {
                    pool.deallocate(table.freed(i).unwrap(), size, stream).unwrap();
                }
            }
        }
        eprintln!("{name}: at the end {:?}", pool.stats());
    }
}

/// A replay's table: slots are reused as allocations are freed (the table holds the most
/// allocations live at once, no more), every free finds its allocation's address, an event that
/// is not a free finds none, and what is left comes back in the order of the ids.
#[test]
fn replay_table_finds_each_free_and_returns_the_rest_in_id_order() {
    let trace = Trace::parse("a,5,100,0\na,3,200,1\nf,5,100,0\na,9,300,0\na,1,400,1\nf,3,200,1\n").unwrap();
    let mut table = trace.replay_table();
    assert_eq!(table.freed(0), None, "an allocation is not a free");
    let mut freed = Vec::new();
    for (i, ev) in trace.events().iter().enumerate() {
        match *ev {
            TraceEvent::Alloc { id, .. } => table.allocated(i, 0x1000 * (id + 1)),
            TraceEvent::Free { id, .. } => freed.push((id, table.freed(i))),
        }
    }
    assert_eq!(freed, [(5, Some(0x6000)), (3, Some(0x4000))]);
    assert_eq!(table.freed(2), None, "freed once");
    assert_eq!(table.live_bytes(), 700);
    assert_eq!(table.live.len(), 3, "slots: the most allocations live at once");
    assert_eq!(table.into_live(), [(0x2000, 400, 1), (0xa000, 300, 0)]);
}

/// A replay that skips a free loses nothing: the allocation whose slot a later one takes stays in
/// the table, its free (noted late) still finds it, and what is left comes back whole.
#[test]
fn replay_table_keeps_an_allocation_whose_free_was_skipped() {
    let trace = Trace::parse("a,1,4096,0\nf,1,4096,0\na,2,8192,0\nf,2,8192,0\na,3,100,0\n").unwrap();
    let mut table = trace.replay_table();
    table.allocated(0, 0x1000);
    // The free of allocation 1 (event 1) is skipped; allocation 2 takes its slot.
    table.allocated(2, 0x2000);
    assert_eq!(table.live_bytes(), 4096 + 8192);
    assert_eq!(table.freed(3), Some(0x2000));
    table.allocated(4, 0x3000);
    assert_eq!(table.live_bytes(), 4096 + 100);
    assert_eq!(table.into_live(), [(0x1000, 4096, 0), (0x3000, 100, 0)]);
    // Noted late, the skipped free finds its allocation.
    let mut table = trace.replay_table();
    table.allocated(0, 0x1000);
    table.allocated(2, 0x2000);
    assert_eq!((table.freed(1), table.freed(1), table.live_bytes()), (Some(0x1000), None, 8192));
}
