//! The header search order of the build script, with temporary folders standing in for installs,
//! and the bindings the build actually used.

#[path = "../build/find.rs"]
#[allow(dead_code)]
mod find;

use std::path::{Path, PathBuf};

fn temp_root(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cudrv-sys-find-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn install(dir: &Path, version: u32) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("cuda.h"), format!("#pragma once\n#define CUDA_VERSION {version}\n")).unwrap();
    dir.to_path_buf()
}

fn inputs(vars: &[(&str, Option<&Path>)], install_dirs: Vec<PathBuf>, site: Vec<PathBuf>) -> find::SearchInputs {
    find::SearchInputs {
        root_vars: find::ROOT_VARS
            .iter()
            .map(|v| {
                let value = vars.iter().find(|(k, _)| k == v).and_then(|(_, p)| p.map(Path::to_path_buf));
                (v.to_string(), value)
            })
            .collect(),
        install_dirs,
        site_packages: site,
    }
}

#[test]
fn environment_variables_come_first_in_their_order() {
    let root = temp_root("vars");
    let home = root.join("home");
    let path = root.join("path");
    install(&home.join("include"), 12090);
    install(&path.join("include"), 13000);
    let sys_dir = install(&root.join("usr/local/cuda/include"), 11080);
    let r =
        find::search(&inputs(&[("CUDA_PATH", Some(&path)), ("CUDA_HOME", Some(&home))], vec![sys_dir.clone()], vec![]));
    let found = r.found.unwrap();
    assert_eq!(found.include_dir, path.join("include"));
    assert_eq!(found.source, "CUDA_PATH");
    // Without CUDA_PATH, CUDA_HOME wins over the install folder.
    let r = find::search(&inputs(&[("CUDA_HOME", Some(&home))], vec![sys_dir.clone()], vec![]));
    assert_eq!(r.found.unwrap().source, "CUDA_HOME");
    // A variable may name the include folder itself.
    let r = find::search(&inputs(&[("CUDA_ROOT", Some(&home.join("include")))], vec![], vec![]));
    assert_eq!(r.found.unwrap().include_dir, home.join("include"));
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn install_folders_then_python_wheels() {
    let root = temp_root("order");
    let empty_var = root.join("empty");
    std::fs::create_dir_all(&empty_var).unwrap();
    let usr = root.join("usr/local/cuda/include");
    let site = root.join("site-packages");
    install(&site.join("nvidia/cuda_runtime/include"), 12090);
    install(&site.join("nvidia/cu13/include"), 13000);
    // Nothing in the install folders: the cu13 wheel comes before cuda_runtime.
    let r = find::search(&inputs(&[("CUDA_PATH", Some(&empty_var))], vec![usr.clone()], vec![site.clone()]));
    let found = r.found.unwrap();
    assert_eq!(found.include_dir, site.join("nvidia/cu13/include"));
    assert_eq!(found.source, "Python wheel");
    assert_eq!(r.looked_in[..3], [empty_var.join("include"), empty_var.clone(), usr.clone()]);
    // An install folder beats the wheels.
    install(&usr, 12000);
    let r = find::search(&inputs(&[], vec![usr.clone()], vec![site]));
    assert_eq!(r.found.unwrap().source, "install folder");
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn nothing_found_lists_every_place() {
    let root = temp_root("none");
    let dirs = vec![root.join("a"), root.join("b")];
    let r = find::search(&inputs(&[], dirs.clone(), vec![root.join("site")]));
    assert!(r.found.is_none());
    assert_eq!(r.looked_in.len(), 4);
    assert_eq!(r.looked_in[..2], dirs[..]);
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn default_install_dirs_per_platform() {
    let linux = find::default_install_dirs("linux");
    assert_eq!(linux[0], PathBuf::from("/usr/local/cuda/include"));
    assert_eq!(linux.last().unwrap(), &PathBuf::from("/usr/include"));
    assert!(find::OTHER_VARS.contains(&"VIRTUAL_ENV"));
}

#[test]
fn versioned_install_folders_newest_first() {
    let root = temp_root("versions");
    for v in ["cuda-11.8", "cuda-12.9", "cuda-12.10", "cuda-x", "other"] {
        std::fs::create_dir_all(root.join(v)).unwrap();
    }
    let found = find::versioned_subdirs(&root, "cuda-");
    let names: Vec<_> = found.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["cuda-12.10", "cuda-12.9", "cuda-11.8"]);
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn reads_the_cuda_version() {
    assert_eq!(find::read_cuda_version("#define CUDA_VERSION 12090\n"), Some(12090));
    assert_eq!(find::read_cuda_version("x\n#define  CUDA_VERSION   13000 \n"), Some(13000));
    assert_eq!(find::read_cuda_version("#define CUDA_VERSION_MAJOR 13\n"), None);
}

/// The committed bindings are quiet unless asked (`CUDRV_SYS_VERBOSE=1`) when nothing was found or
/// they were asked for; a header that was found but could not be used always warns.
#[test]
fn the_bindings_source_warns_only_on_failure_or_on_request() {
    let fallback = |failed| find::Outcome::Fallback { version: 13000, reason: "no cuda.h was found".into(), failed };
    assert_eq!(fallback(false).source(), "fallback (no cuda.h was found)");
    assert_eq!(fallback(false).warning(false), None);
    let verbose = fallback(false).warning(true).unwrap();
    assert_eq!(verbose, "using the committed CUDA 13.0 bindings: no cuda.h was found");
    assert_eq!(fallback(true).warning(false).as_deref(), Some(verbose.as_str()));

    let found = find::Found { include_dir: PathBuf::from("/opt/cuda/include"), source: "CUDA_PATH".into() };
    let generated = find::Outcome::Generated { raw: String::new(), version: 12090, found: found.clone() };
    assert_eq!(generated.source(), format!("generated from {} (CUDA_PATH)", found.include_dir.display()));
    assert_eq!(generated.warning(false), None);
    let verbose = generated.warning(true).unwrap();
    assert!(verbose.starts_with("bindings generated from the CUDA 12.9 headers in "), "{verbose}");
}

/// The bindings the build used. `.ci/run` sets `CUDRV_SYS_EXPECT_BINDINGS` to `fallback` or
/// `generated` in each lane, so that the lane fails if the build did something else.
#[test]
fn bindings_source_is_the_expected_one() {
    let source = cudrv_sys::BINDINGS_SOURCE;
    match std::env::var("CUDRV_SYS_EXPECT_BINDINGS").as_deref() {
        Ok("fallback") => {
            assert!(source.starts_with("fallback ("), "{source}");
            assert_eq!(cudrv_sys::CUDA_HEADER_VERSION, 13000);
        }
        Ok("generated") => assert!(source.starts_with("generated from "), "{source}"),
        Ok(other) => panic!("CUDRV_SYS_EXPECT_BINDINGS={other}: expected fallback or generated"),
        Err(_) => assert!(source.starts_with("fallback (") || source.starts_with("generated from "), "{source}"),
    }
    if let Ok(version) = std::env::var("CUDRV_SYS_EXPECT_VERSION") {
        assert_eq!(cudrv_sys::CUDA_HEADER_VERSION.to_string(), version);
    }
    // Either way, the table resolves functions and names codes.
    assert_eq!(cudrv_sys::result_name(cudrv_sys::CUresult::CUDA_ERROR_NOT_SUPPORTED), Some("CUDA_ERROR_NOT_SUPPORTED"));
    assert!(!cudrv_sys::Driver::candidates().is_empty());
}
