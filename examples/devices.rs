//! The main job: what each GPU supports, its driver model, and which memory resource cudrv picks.
//!
//! ```text
//! cargo run --example devices            # a readable report
//! cargo run --example devices -- --json  # the same, as JSON
//! ```
//!
//! Without a driver it prints the paths it tried and exits with status 1. `--help` prints the
//! usage; an unknown argument prints it to stderr and exits with status 2.

use std::process::ExitCode;

use cudrv::{Device, Error};

const USAGE: &str = "\
usage: devices [--json]
  --json      print the report as JSON
  -h, --help  print this help";

fn main() -> ExitCode {
    let mut json = false;
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--json" => json = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            other => {
                eprintln!("devices: unknown argument {other}\n{USAGE}");
                return ExitCode::from(2);
            }
        }
    }
    match run(json) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

struct Report {
    ordinal: usize,
    name: String,
    uuid: String,
    pci_bus_id: String,
    memory: usize,
    caps: &'static cudrv::Capabilities,
    resource: String,
    resource_reason: String,
}

fn run(json: bool) -> Result<(), Error> {
    let driver_version = cudrv::driver_version()?;
    let mut reports = Vec::new();
    for device in Device::all()? {
        let choice = cudrv::memory::choose(&device)?;
        reports.push(Report {
            ordinal: device.ordinal(),
            name: device.name()?,
            uuid: device.uuid_string()?,
            pci_bus_id: device.pci_bus_id()?,
            memory: device.total_memory()?,
            caps: device.capabilities()?,
            resource: choice.kind.to_string(),
            resource_reason: choice.reason,
        });
    }
    if json {
        print_json(driver_version, &reports);
    } else {
        print_text(driver_version, &reports);
    }
    Ok(())
}

fn print_text(driver_version: i32, reports: &[Report]) {
    println!(
        "CUDA driver {}.{} ({} device{}), cudrv built against CUDA {}.{} headers",
        driver_version / 1000,
        driver_version % 1000 / 10,
        reports.len(),
        if reports.len() == 1 { "" } else { "s" },
        cudrv::HEADER_VERSION / 1000,
        cudrv::HEADER_VERSION % 1000 / 10
    );
    for r in reports {
        println!();
        println!("device {}: {}", r.ordinal, r.name);
        println!("  uuid                        {}", r.uuid);
        println!("  pci bus id                  {}", r.pci_bus_id);
        println!("  memory                      {:.1} GiB", r.memory as f64 / f64::from(1u32 << 30));
        for line in r.caps.to_string().lines() {
            println!("  {line}");
        }
        println!("  memory resource             {}", r.resource);
        println!("    why                       {}", r.resource_reason);
    }
}

fn print_json(driver_version: i32, reports: &[Report]) {
    let mut out =
        format!("{{\"driver_version\":{driver_version},\"header_version\":{},\"devices\":[", cudrv::HEADER_VERSION);
    for (i, r) in reports.iter().enumerate() {
        let c = r.caps;
        if i > 0 {
            out.push(',');
        }
        out.push_str(&format!(
            concat!(
                "{{\"ordinal\":{},\"name\":{},\"uuid\":{},\"pci_bus_id\":{},\"total_memory\":{},",
                "\"compute_capability\":\"{}.{}\",\"driver_model\":{},\"memory_pools\":{},",
                "\"memory_pool_handle_types\":{},\"virtual_memory_management\":{},\"managed_memory\":{},",
                "\"concurrent_managed_access\":{},\"pageable_memory_access\":{},\"host_register\":{},",
                "\"stream_priority_range\":{{\"greatest\":{},\"least\":{}}},",
                "\"cooperative_launch\":{},\"cluster_launch\":{},",
                "\"unified_addressing\":{},\"integrated\":{},\"managed_prefetch\":{},",
                "\"programmatic_dependent_launch\":{},\"mem_sync_domain_count\":{},",
                "\"max_access_policy_window_size\":{},\"max_persisting_l2_cache_size\":{},",
                "\"preferred_cluster_dimension\":{},\"ipc_events\":{},\"legacy_ipc\":{},",
                "\"memory_resource\":{},\"memory_resource_reason\":{}}}"
            ),
            r.ordinal,
            quote(&r.name),
            quote(&r.uuid),
            quote(&r.pci_bus_id),
            r.memory,
            c.compute_capability.0,
            c.compute_capability.1,
            quote(&c.driver_model.to_string()),
            c.memory_pools,
            c.memory_pool_handle_types,
            c.virtual_memory_management,
            c.managed_memory,
            c.concurrent_managed_access,
            c.pageable_memory_access,
            c.host_register,
            c.stream_priority_range.1,
            c.stream_priority_range.0,
            c.cooperative_launch,
            c.cluster_launch,
            c.unified_addressing,
            c.integrated,
            c.managed_prefetch,
            c.programmatic_dependent_launch,
            c.mem_sync_domain_count,
            c.max_access_policy_window_size,
            c.max_persisting_l2_cache_size,
            c.preferred_cluster_dimension,
            c.ipc_events,
            c.legacy_ipc,
            quote(&r.resource),
            quote(&r.resource_reason),
        ));
    }
    out.push_str("]}");
    println!("{out}");
}

/// A JSON string literal.
fn quote(s: &str) -> String {
    let mut q = String::with_capacity(s.len() + 2);
    q.push('"');
    for ch in s.chars() {
        match ch {
            '"' => q.push_str("\\\""),
            '\\' => q.push_str("\\\\"),
            c if (c as u32) < 0x20 => q.push_str(&format!("\\u{:04x}", c as u32)),
            c => q.push(c),
        }
    }
    q.push('"');
    q
}
