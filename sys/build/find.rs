//! Finding `cuda.h`, and what the build says about the bindings it used. Shared by `build.rs` and
//! by the crate's tests (`tests/header_search.rs`), so that the search order is tested with
//! temporary folders standing in for real installs.

use std::path::{Path, PathBuf};

/// The environment variables that name a CUDA toolkit root, in the order they are tried. Each is
/// looked at as `<value>/include/cuda.h` (and `<value>/cuda.h`, for a variable that names the
/// include folder itself).
pub const ROOT_VARS: [&str; 4] = ["CUDA_PATH", "CUDA_HOME", "CUDA_ROOT", "CUDA_TOOLKIT_ROOT_DIR"];

/// The other environment variables the search reads (for `rerun-if-env-changed`).
pub const OTHER_VARS: [&str; 4] = ["VIRTUAL_ENV", "CONDA_PREFIX", "PYTHON", "CUDRV_PYTHON"];

/// Where a header was found, and why that place was tried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// The folder that holds `cuda.h`.
    pub include_dir: PathBuf,
    /// A short description of the source (`CUDA_PATH`, `install folder`, `Python wheel`).
    pub source: String,
}

/// The inputs of a search. Everything the search reads from the machine goes through here, so
/// tests can replace it.
pub struct SearchInputs {
    /// Values of [`ROOT_VARS`], in that order (None when unset or empty).
    pub root_vars: Vec<(String, Option<PathBuf>)>,
    /// The usual install folders, in order of preference (see [`default_install_dirs`]).
    pub install_dirs: Vec<PathBuf>,
    /// Python `site-packages` folders, in order of preference.
    pub site_packages: Vec<PathBuf>,
}

/// The result of a search: the header (if any) and every place that was looked at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SearchResult {
    /// The first folder with a `cuda.h`.
    pub found: Option<Found>,
    /// Every folder that was looked in, in order.
    pub looked_in: Vec<PathBuf>,
}

/// Runs the search over `inputs`: environment variables, then install folders, then Python wheels.
pub fn search(inputs: &SearchInputs) -> SearchResult {
    let mut looked_in = Vec::new();
    let try_dir = |dir: PathBuf, source: &str, looked_in: &mut Vec<PathBuf>| {
        let hit = dir.join("cuda.h").is_file();
        looked_in.push(dir.clone());
        hit.then(|| Found { include_dir: dir, source: source.to_string() })
    };
    for (var, value) in &inputs.root_vars {
        let Some(root) = value else { continue };
        for dir in [root.join("include"), root.clone()] {
            if let Some(found) = try_dir(dir, var, &mut looked_in) {
                return SearchResult { found: Some(found), looked_in };
            }
        }
    }
    for dir in &inputs.install_dirs {
        if let Some(found) = try_dir(dir.clone(), "install folder", &mut looked_in) {
            return SearchResult { found: Some(found), looked_in };
        }
    }
    for site in &inputs.site_packages {
        for wheel in ["nvidia/cu13/include", "nvidia/cuda_runtime/include"] {
            if let Some(found) = try_dir(site.join(wheel), "Python wheel", &mut looked_in) {
                return SearchResult { found: Some(found), looked_in };
            }
        }
    }
    SearchResult { found: None, looked_in }
}

/// Which bindings the build uses, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// bindgen ran on the header in `found`, whose `CUDA_VERSION` is `version`.
    Generated {
        /// The raw bindgen output.
        raw: String,
        /// The header's `CUDA_VERSION`.
        version: u32,
        /// Where the header is.
        found: Found,
    },
    /// The committed bindings, generated from the CUDA `version` headers.
    Fallback {
        /// The `CUDA_VERSION` of the committed bindings.
        version: u32,
        /// Why they are used.
        reason: String,
        /// A header was found but could not be used (libclang missing, bindgen failing on it). Not
        /// set when there is no header or when the fallback was asked for: that is the normal
        /// case on a machine without a CUDA toolkit, and on docs.rs.
        failed: bool,
    },
}

impl Outcome {
    /// The value of `cudrv_sys::BINDINGS_SOURCE`: `generated from <include dir> (<why there>)`
    /// or `fallback (<why>)`.
    pub fn source(&self) -> String {
        match self {
            Outcome::Generated { found, .. } => {
                format!("generated from {} ({})", found.include_dir.display(), found.source)
            }
            Outcome::Fallback { reason, .. } => format!("fallback ({reason})"),
        }
    }

    /// The build warning to print, if any: only when something was found and failed, unless
    /// `verbose` (`CUDRV_SYS_VERBOSE=1`) asks for the source in every case.
    pub fn warning(&self, verbose: bool) -> Option<String> {
        let failed = matches!(self, Outcome::Fallback { failed: true, .. });
        if !failed && !verbose {
            return None;
        }
        Some(match self {
            Outcome::Generated { version, found, .. } => format!(
                "bindings generated from the CUDA {} headers in {} ({})",
                version_name(*version),
                found.include_dir.display(),
                found.source
            ),
            Outcome::Fallback { version, reason, .. } => {
                format!("using the committed CUDA {} bindings: {reason}", version_name(*version))
            }
        })
    }
}

/// `13000` as `13.0`, `12090` as `12.9`.
fn version_name(version: u32) -> String {
    format!("{}.{}", version / 1000, version % 1000 / 10)
}

/// The usual install folders for `target_os`: the fixed ones first, then versioned folders
/// (`/usr/local/cuda-12.9`, `...\CUDA\v13.0`) from the newest version down.
pub fn default_install_dirs(target_os: &str) -> Vec<PathBuf> {
    if target_os == "windows" {
        let mut roots = Vec::new();
        for base in [
            r"C:\Program Files\NVIDIA GPU Computing Toolkit\CUDA",
            "/c/Program Files/NVIDIA GPU Computing Toolkit/CUDA",
        ] {
            roots.extend(versioned_subdirs(Path::new(base), "v"));
        }
        return roots.into_iter().map(|r| r.join("include")).collect();
    }
    let mut dirs = vec![PathBuf::from("/usr/local/cuda/include"), PathBuf::from("/opt/cuda/include")];
    dirs.extend(versioned_subdirs(Path::new("/usr/local"), "cuda-").into_iter().map(|r| r.join("include")));
    dirs.push(PathBuf::from("/usr/include"));
    dirs
}

/// The subfolders of `parent` named `<prefix><version>`, newest version first.
pub fn versioned_subdirs(parent: &Path, prefix: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(parent) else { return Vec::new() };
    let mut found: Vec<(Vec<u32>, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let version = name.strip_prefix(prefix)?;
            let key: Option<Vec<u32>> = version.split('.').map(|p| p.parse().ok()).collect();
            Some((key?, e.path()))
        })
        .collect();
    found.sort_by(|a, b| b.0.cmp(&a.0));
    found.into_iter().map(|(_, p)| p).collect()
}

/// Reads `#define CUDA_VERSION <n>` from a `cuda.h`.
pub fn read_cuda_version(header: &str) -> Option<u32> {
    header.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        match (words.next(), words.next(), words.next()) {
            (Some("#define"), Some("CUDA_VERSION"), Some(v)) => v.parse().ok(),
            _ => None,
        }
    })
}
