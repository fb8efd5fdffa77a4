//! Build script of the safe crate: turns the CUDA header version that cudrv-sys publishes
//! (`DEP_CUDA_VERSION`, from `links = "cuda"`) into cfgs, so that APIs can be gated on the header
//! the bindings came from: `cuda_12000` is set for CUDA 12.0 headers and newer, and so on.

/// The header versions that have a cfg. Add one when an API needs it.
const GATES: [u32; 8] = [11020, 11030, 11080, 12000, 12050, 12080, 12090, 13000];

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_CUDA_VERSION");
    println!("cargo:rerun-if-changed=build.rs");
    for gate in GATES {
        println!("cargo::rustc-check-cfg=cfg(cuda_{gate})");
    }
    let version: u32 = std::env::var("DEP_CUDA_VERSION")
        .ok()
        .and_then(|v| v.parse().ok())
        .expect("cudrv-sys publishes DEP_CUDA_VERSION");
    for gate in GATES.into_iter().filter(|g| *g <= version) {
        println!("cargo:rustc-cfg=cuda_{gate}");
    }
    println!("cargo:rustc-env=CUDRV_HEADER_VERSION={version}");
}
