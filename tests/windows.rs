//! Windows-only behaviour: where `nvcuda.dll` is loaded from, the safe search flags (no DLL
//! planting), the loader's error text from `GetLastError`, and the driver model and memory resource
//! per mode of the fake.
//!
//! In CI these run under Wine (`.ci/windows`), with the fake `nvcuda.dll` copied into the Wine
//! prefix's `system32`. Tests that need the fake there skip with a message when it is not (a
//! machine without it, or one with a real NVIDIA driver). As in `tests/fake/basics.rs`, every body runs in a
//! child process (`run_with_fake`), and tests never set environment variables in this process.
#![cfg(windows)]

use std::ffi::{OsString, c_void};
use std::os::windows::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use cudrv::memory::{DeviceBuffer, ResourceKind};
use cudrv::sys::Driver;
use cudrv::{Device, DriverModel, Error, Stream};
use cudrv_test_support::{
    assert_no_leaks, fake_driver_path, fake_driver_version, in_fake_child, legacy_fake_driver_path,
    output_retrying_start, run_with_fake, run_with_fake_modes, testing_oldest_driver,
};

/// Driver version that the full fake reports by default, and the one of the legacy (CUDA 11.1) fake.
const FAKE_VERSION: i32 = cudrv_test_support::FULL_DRIVER_VERSION;
const LEGACY_VERSION: i32 = cudrv_test_support::LEGACY_DRIVER_VERSION;

/// Checks the choice of resource for a device that is not in TCC mode: the driver's pool, or on
/// the CUDA 11.1 fake (`CUDRV_TEST_DRIVER=legacy`), which predates memory pools, cudrv's pool, with
/// `DriverPool` refused. Returns whether the driver's pool was chosen.
fn check_wddm_choice(dev: &Device) -> bool {
    let choice = cudrv::memory::choose(dev).unwrap();
    if !testing_oldest_driver() {
        assert_eq!(choice.kind, ResourceKind::DriverPool, "{}", choice.reason);
        return true;
    }
    assert_eq!(choice.kind, ResourceKind::StreamOrderedPool, "{}", choice.reason);
    assert!(choice.reason.contains("the driver (11.1) predates memory pools (CUDA 11.2)"), "{}", choice.reason);
    let refused = cudrv::memory::DriverPool::default_pool(dev).unwrap_err();
    assert!(matches!(refused, Error::Unsupported { feature: "memory pools", .. }), "{refused:?}");
    false
}

#[link(name = "kernel32")]
unsafe extern "system" {
    fn GetSystemDirectoryW(buffer: *mut u16, size: u32) -> u32;
    fn GetModuleHandleW(name: *const u16) -> *mut c_void;
    fn GetModuleFileNameW(module: *mut c_void, buffer: *mut u16, size: u32) -> u32;
    fn LoadLibraryW(name: *const u16) -> *mut c_void;
}

fn wide(s: &str) -> Vec<u16> {
    std::ffi::OsStr::new(s).encode_wide().chain(Some(0)).collect()
}

/// The system folder (`C:\windows\system32`), where the NVIDIA driver installs `nvcuda.dll`.
fn system_dir() -> PathBuf {
    let mut buf = vec![0u16; 1024];
    // SAFETY: `buf` is writable for the length passed.
    let n = unsafe { GetSystemDirectoryW(buf.as_mut_ptr(), buf.len() as u32) } as usize;
    assert!(n > 0 && n < buf.len(), "GetSystemDirectoryW failed: {}", std::io::Error::last_os_error());
    PathBuf::from(OsString::from_wide(&buf[..n]))
}

/// The file behind an already loaded module, by its name; `None` when no such module is loaded.
fn loaded_module_file(name: &str) -> Option<PathBuf> {
    let name = wide(name);
    // SAFETY: `name` is NUL-terminated; GetModuleHandleW takes no reference.
    let module = unsafe { GetModuleHandleW(name.as_ptr()) };
    if module.is_null() {
        return None;
    }
    module_file(module)
}

fn module_file(module: *mut c_void) -> Option<PathBuf> {
    let mut buf = vec![0u16; 32768];
    // SAFETY: `module` is a loaded module (it is never unloaded here); `buf` is writable for the
    // length passed.
    let n = unsafe { GetModuleFileNameW(module, buf.as_mut_ptr(), buf.len() as u32) } as usize;
    (n > 0).then(|| PathBuf::from(OsString::from_wide(&buf[..n])))
}

/// Case-insensitive path comparison, as the file system compares them.
fn same_path(a: &Path, b: &Path) -> bool {
    a.to_string_lossy().replace('/', "\\").eq_ignore_ascii_case(&b.to_string_lossy().replace('/', "\\"))
}

/// `system32\nvcuda.dll` when it is the fake driver (it exports `cudrvFakeReport`); `None` when
/// there is no `nvcuda.dll` there, or a real one.
fn fake_in_system_dir() -> Option<PathBuf> {
    let path = system_dir().join("nvcuda.dll");
    let bytes = std::fs::read(&path).ok()?;
    bytes.windows(b"cudrvFakeReport".len()).any(|w| w == b"cudrvFakeReport").then_some(path)
}

fn skip(test: &str, why: &str) {
    eprintln!("{test}: skipped: {why}");
}

#[test]
fn nvcuda_dll_is_loaded_from_the_system_folder() {
    let Some(sys_fake) = fake_in_system_dir() else {
        skip(
            "nvcuda_dll_is_loaded_from_the_system_folder",
            "the fake nvcuda.dll is not in the system folder (.ci/windows puts it there)",
        );
        return;
    };
    let sys_dir = system_dir().to_string_lossy().into_owned();
    // An empty CUDRV_DRIVER_PATH means "not set". CUDRV_TEST_LIB_DIR makes the runner's leak and
    // violation checks read the same library instance that cudrv loaded: the full fake there
    // (CUDRV_TEST_DRIVER=full), whatever this run's CUDRV_TEST_DRIVER says.
    let env = [
        ("CUDRV_DRIVER_PATH", ""),
        ("CUDRV_TEST_LIB_DIR", sys_dir.as_str()),
        ("CUDRV_TEST_DRIVER", "full"),
        ("CUDRV_FAKE_MODE", "tcc"),
    ];
    run_with_fake(&env, || {
        assert_eq!(Driver::candidates(), [PathBuf::from("nvcuda.dll")]);
        let driver = Driver::global().unwrap();
        assert_eq!(driver.library_path(), "nvcuda.dll");
        assert_eq!(driver.version(), FAKE_VERSION);
        let loaded = loaded_module_file("nvcuda.dll").expect("nvcuda.dll is loaded");
        assert!(same_path(&loaded, &sys_fake), "nvcuda.dll was loaded from {}", loaded.display());
        let dev = Device::get(0).unwrap();
        assert_eq!(dev.driver_model().unwrap(), DriverModel::Tcc);
        let s = Stream::new(&dev).unwrap();
        let buf = DeviceBuffer::from_slice(&[7u32; 100], &s).unwrap();
        assert_eq!(buf.resource().kind(), ResourceKind::StreamOrderedPool);
        assert_eq!(buf.to_vec().unwrap(), [7u32; 100]);
        drop(buf);
        dev.memory_resource().unwrap().trim(0).unwrap();
        drop(s);
        // The events the context keeps for host waits.
        dev.primary_context().unwrap().release_cached_events();
        assert_no_leaks();
    });
}

/// Set in the copy of this test binary that `planted_nvcuda_dll_is_not_loaded` starts.
const PLANTED_ENV: &str = "CUDRV_WINDOWS_PLANTED";

/// A `nvcuda.dll` planted in the current directory and beside the executable (the two places the
/// default DLL search looks first) is never loaded. The planted DLL is the legacy fake, which
/// reports driver version 11.1, so loading it would be visible even where no other driver exists.
#[test]
fn planted_nvcuda_dll_is_not_loaded() {
    const NAME: &str = "planted_nvcuda_dll_is_not_loaded";
    if std::env::var_os(PLANTED_ENV).is_none() {
        // Outer run: plant, then run this test again from a copy of this binary, in that folder.
        let dir = std::env::temp_dir().join(format!("cudrv-planted-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(legacy_fake_driver_path(), dir.join("nvcuda.dll")).unwrap();
        let exe = std::env::current_exe().unwrap();
        let copy = dir.join("planted-test.exe");
        std::fs::copy(&exe, &copy).unwrap();
        // Under Wine the binary needs the bcryptprimitives.dll stub beside it.
        let stub = exe.with_file_name("bcryptprimitives.dll");
        if stub.exists() {
            std::fs::copy(&stub, dir.join("bcryptprimitives.dll")).unwrap();
        }
        let mut cmd = Command::new(&copy);
        cmd.args([NAME, "--exact", "--nocapture", "--test-threads=1"]).current_dir(&dir).env(PLANTED_ENV, "1");
        let out = output_retrying_start(&mut cmd).unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            out.status.success() && stdout.contains("test result: ok. 1 passed"),
            "the planted-DLL run failed ({})\n---- stdout ----\n{stdout}\n---- stderr ----\n{stderr}",
            out.status
        );
        return;
    }
    // Inner run, from the copy: the current directory and the executable's folder hold the plant.
    let here = std::env::current_dir().unwrap();
    let planted = here.join("nvcuda.dll");
    assert!(planted.exists() && same_path(&std::env::current_exe().unwrap().with_file_name("nvcuda.dll"), &planted));
    let sys_fake = fake_in_system_dir();
    let real_driver = sys_fake.is_none() && system_dir().join("nvcuda.dll").exists();
    run_with_fake(&[("CUDRV_DRIVER_PATH", "")], move || {
        match Driver::global() {
            Ok(driver) => {
                assert_ne!(driver.version(), LEGACY_VERSION, "the planted nvcuda.dll was loaded");
                let loaded = loaded_module_file("nvcuda.dll").expect("nvcuda.dll is loaded");
                assert!(!same_path(&loaded, &planted), "the planted nvcuda.dll was loaded");
                assert!(same_path(&loaded, &system_dir().join("nvcuda.dll")), "loaded {}", loaded.display());
                if sys_fake.is_some() {
                    assert_eq!(driver.version(), FAKE_VERSION);
                }
            }
            Err(e) => {
                assert!(sys_fake.is_none() && !real_driver, "the driver in the system folder did not load: {e}");
                assert_eq!(e.attempts.len(), 1);
                assert_eq!(e.attempts[0].path, "nvcuda.dll");
                assert!(loaded_module_file("nvcuda.dll").is_none(), "a nvcuda.dll was loaded after all");
                // The control: the default search does find the plant, so the test above means something.
                let name = wide("nvcuda.dll");
                // SAFETY: loads the legacy fake, whose initialisers are sound to run; it stays loaded.
                let module = unsafe { LoadLibraryW(name.as_ptr()) };
                assert!(!module.is_null(), "the default DLL search did not find the planted nvcuda.dll");
                let file = module_file(module).unwrap();
                assert!(same_path(&file, &planted), "the default search loaded {}", file.display());
            }
        }
    });
}

#[test]
fn no_driver_in_the_system_folder() {
    if system_dir().join("nvcuda.dll").exists() {
        skip("no_driver_in_the_system_folder", "a nvcuda.dll is in the system folder");
        return;
    }
    run_with_fake(&[("CUDRV_DRIVER_PATH", "")], || {
        let err = Device::count().unwrap_err();
        let Error::DriverNotFound { attempts } = &err else { panic!("expected DriverNotFound, got {err}") };
        assert_eq!(attempts.len(), 1);
        assert_eq!(attempts[0].path, "nvcuda.dll");
        // ERROR_MOD_NOT_FOUND, with the system's text, through libloading.
        assert!(attempts[0].reason.starts_with("LoadLibraryExW failed: "), "{}", attempts[0].reason);
        assert!(attempts[0].reason.ends_with("(os error 126)"), "{}", attempts[0].reason);
        let text = err.to_string();
        assert!(text.contains("nvcuda.dll") && text.contains("CUDRV_DRIVER_PATH"), "{text}");
    });
}

#[test]
fn driver_path_to_a_missing_file_reports_the_windows_error() {
    let missing = std::env::temp_dir().join("cudrv-no-such-folder").join("nvcuda.dll");
    let path = missing.to_string_lossy().into_owned();
    assert!(missing.is_absolute() && !missing.exists());
    run_with_fake(&[("CUDRV_DRIVER_PATH", &path)], || {
        let err = Device::count().unwrap_err();
        let Error::DriverNotFound { attempts } = &err else { panic!("expected DriverNotFound, got {err}") };
        assert_eq!(attempts.len(), 1);
        assert_eq!(attempts[0].path, path);
        let reason = &attempts[0].reason;
        // libloading's text, then GetLastError's message and code: ERROR_MOD_NOT_FOUND.
        assert!(reason.starts_with("LoadLibraryExW failed: "), "{reason}");
        assert!(reason.ends_with("(os error 126)"), "{reason}");
        assert!(reason.len() > "LoadLibraryExW failed: (os error 126)".len(), "no message text: {reason}");
        assert!(err.to_string().contains(&path), "{err}");
        // The failure is kept.
        assert!(matches!(cudrv::driver_version(), Err(Error::DriverNotFound { .. })));
    });
}

#[test]
fn driver_path_to_a_file_that_is_not_a_dll() {
    // Made by the parent only; the child reads its name from CUDRV_DRIVER_PATH.
    let file = std::env::temp_dir().join(format!("cudrv-not-a-dll-{}.dll", std::process::id()));
    let path = file.to_string_lossy().into_owned();
    if !in_fake_child() {
        std::fs::write(&file, b"this is not a DLL").unwrap();
    }
    run_with_fake(&[("CUDRV_DRIVER_PATH", &path)], || {
        let err = Device::count().unwrap_err();
        let Error::DriverNotFound { attempts } = &err else { panic!("expected DriverNotFound, got {err}") };
        assert_eq!(Some(attempts[0].path.as_str()), std::env::var("CUDRV_DRIVER_PATH").ok().as_deref());
        assert!(attempts[0].path.contains("cudrv-not-a-dll-"), "{}", attempts[0].path);
        // ERROR_BAD_EXE_FORMAT.
        assert!(attempts[0].reason.starts_with("LoadLibraryExW failed: "), "{}", attempts[0].reason);
        assert!(attempts[0].reason.ends_with("(os error 193)"), "{}", attempts[0].reason);
    });
    if !in_fake_child() {
        let _ = std::fs::remove_file(file);
    }
}

#[test]
fn driver_path_to_a_dll_that_is_not_a_driver() {
    let kernel32 = system_dir().join("kernel32.dll");
    let path = kernel32.to_string_lossy().into_owned();
    run_with_fake(&[("CUDRV_DRIVER_PATH", &path)], || {
        let err = Device::count().unwrap_err();
        let Error::DriverNotFound { attempts } = &err else { panic!("expected DriverNotFound, got {err}") };
        let reason = &attempts[0].reason;
        // ERROR_PROC_NOT_FOUND for cuDriverGetVersion.
        assert!(reason.starts_with("not a CUDA driver: GetProcAddress failed"), "{reason}");
        assert!(reason.ends_with("(os error 127)"), "{reason}");
    });
}

#[test]
fn driver_path_with_forward_slashes() {
    let path = std::path::absolute(fake_driver_path()).unwrap().to_string_lossy().replace('\\', "/");
    run_with_fake(&[("CUDRV_DRIVER_PATH", &path), ("CUDRV_FAKE_MODE", "wddm")], || {
        let driver = Driver::global().unwrap();
        assert_eq!(driver.library_path(), path);
        assert_eq!(driver.version(), fake_driver_version());
        assert_eq!(Device::get(0).unwrap().driver_model().unwrap(), DriverModel::Wddm);
    });
}

#[test]
fn legacy_driver_by_path() {
    // CUDA 11.1: no cuGetProcAddress, no pools; the exported symbols are found by name.
    let path = legacy_fake_driver_path().to_string_lossy().into_owned();
    run_with_fake(&[("CUDRV_DRIVER_PATH", &path), ("CUDRV_FAKE_MODE", "wddm")], || {
        let driver = Driver::global().unwrap();
        assert_eq!(driver.version(), LEGACY_VERSION);
        assert!(!driver.has_get_proc_address());
        let dev = Device::get(0).unwrap();
        assert_eq!(dev.driver_model().unwrap(), DriverModel::Wddm);
        let (_, choice) = dev.memory_resource_choice().unwrap();
        assert_eq!(choice.kind, ResourceKind::StreamOrderedPool, "{}", choice.reason);
        // Without CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED (12.0), IPC is Linux's: refused, saying why.
        let Err(Error::Unsupported { feature: "interprocess events", reason, .. }) = cudrv::ipc::IpcEvent::new(&dev)
        else {
            panic!("IPC events on Windows with CUDA 11.1")
        };
        assert!(reason.contains("the driver (11.1) predates CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED"), "{reason}");
    });
}

#[test]
fn driver_model_per_mode() {
    // The driver API tells only TCC apart: on Windows everything else is WDDM, the fake's "linux"
    // mode included.
    for (mode, expected) in [("linux", DriverModel::Wddm), ("wddm", DriverModel::Wddm), ("tcc", DriverModel::Tcc)] {
        run_with_fake(&[("CUDRV_FAKE_MODE", mode)], || {
            let dev = Device::get(0).unwrap();
            assert_eq!(dev.driver_model().unwrap(), expected);
            let caps = dev.capabilities().unwrap();
            assert_eq!(caps.driver_model, expected);
            assert_eq!(caps.memory_pools, mode != "tcc" && !testing_oldest_driver());
            let report = caps.to_string();
            let shown = if expected == DriverModel::Tcc { "TCC" } else { "WDDM" };
            assert!(report.contains(&format!("driver model                {shown}")), "{report}");
        });
    }
    run_with_fake(&[("CUDRV_FAKE_DEVICES", "wddm,tcc")], || {
        let models: Vec<DriverModel> = Device::all().unwrap().iter().map(|d| d.driver_model().unwrap()).collect();
        assert_eq!(models, [DriverModel::Wddm, DriverModel::Tcc]);
    });
}

#[test]
fn tcc_allocates_from_the_stream_ordered_pool() {
    run_with_fake(&[("CUDRV_FAKE_MODE", "tcc")], || {
        let dev = Device::get(0).unwrap();
        let (resource, choice) = dev.memory_resource_choice().unwrap();
        assert_eq!(choice.kind, ResourceKind::StreamOrderedPool);
        assert!(choice.reason.contains("TCC"), "{}", choice.reason);
        let s = Stream::new(&dev).unwrap();
        let data: Vec<u32> = (0..10_000).collect();
        let a = DeviceBuffer::from_slice(&data, &s).unwrap();
        let mut b = DeviceBuffer::<u32>::zeroed(data.len(), &s).unwrap();
        b.copy_from(&a).unwrap();
        assert_eq!(b.to_vec().unwrap(), data);
        assert_eq!(a.resource().kind(), ResourceKind::StreamOrderedPool);
        // The stream-ordered pool gets its memory with cuMemAlloc.
        let stats = resource.stats().unwrap();
        assert!(stats.driver_allocations >= 1, "{stats:?}");
        assert!(stats.in_use >= 2 * data.len() * 4, "{stats:?}");
        drop((a, b));
        resource.trim(0).unwrap();
        drop(s);
        // The events the context keeps for host waits.
        dev.primary_context().unwrap().release_cached_events();
        assert_no_leaks();
    });
}

#[test]
fn wddm_allocates_from_the_driver_pool() {
    // Every cuMemAlloc fails: allocation works only through the driver's pool.
    run_with_fake(&[("CUDRV_FAKE_MODE", "wddm"), ("CUDRV_FAKE_FAIL", "cuMemAlloc_v2:1+:2")], || {
        let dev = Device::get(0).unwrap();
        if !check_wddm_choice(&dev) {
            return; // CUDA 11.1: no driver's pool (checked), and cudrv's pool needs cuMemAlloc
        }
        let (resource, choice) = dev.memory_resource_choice().unwrap();
        assert_eq!(choice.kind, ResourceKind::DriverPool, "{}", choice.reason);
        let s = Stream::new(&dev).unwrap();
        let data: Vec<u32> = (0..10_000).collect();
        let buf = DeviceBuffer::from_slice(&data, &s).unwrap();
        assert_eq!(buf.to_vec().unwrap(), data);
        assert_eq!(buf.resource().kind(), ResourceKind::DriverPool);
        assert_eq!(resource.kind(), ResourceKind::DriverPool, "the pool fell back");
        drop(buf);
        resource.trim(0).unwrap();
        drop(s);
        // The events the context keeps for host waits.
        dev.primary_context().unwrap().release_cached_events();
        assert_no_leaks();
    });
}

#[test]
fn resource_choice_per_mode() {
    run_with_fake_modes(&["linux", "wddm", "tcc"], &[], || {
        let dev = Device::get(0).unwrap();
        if dev.driver_model().unwrap() == DriverModel::Tcc {
            let choice = cudrv::memory::choose(&dev).unwrap();
            assert_eq!(choice.kind, ResourceKind::StreamOrderedPool, "{}", choice.reason);
        } else {
            check_wddm_choice(&dev);
        }
    });
}
