//! The TCC interposer (`libcudrv_tcc.so`, built by `cudrv-test-support`) on the fake driver.
//!
//! The interposer forwards to the driver named by `CUDRV_TCC_REAL_DRIVER` and makes it look like a
//! Windows device in TCC mode: no memory pools, the TCC flag set, and 801 from every pool entry
//! point. Here the "real" driver is the fake of CUDA 13.0 in `linux` mode (which has pools), whatever
//! `CUDRV_TEST_DRIVER` says, so everything TCC about the device comes from the interposer; one test
//! puts it over the CUDA 11.1 fake. On a GPU, the same library runs the whole suite
//! against the real driver (see the README).
//!
//! Each body runs in a child process (`run_with_fake`) with `CUDRV_DRIVER_PATH` at the interposer.

use cudrv::memory::{self, DeviceBuffer, ResourceKind};
use cudrv::sys::{CUdeviceptr, CUmemAllocationHandleType, CUmemPool_attribute, CUmemoryPool, CUresult, Driver};
use cudrv::{Device, DriverModel, Stream};
use cudrv_test_support::{
    TCC_INTERPOSER_AVAILABLE, assert_no_leaks, full_fake_driver_path, legacy_fake_driver_path, run_with_fake,
    tcc_interposer_path,
};

/// Runs `body` in a child with the interposer as the driver, forwarding to `real` (the fake in
/// `linux` mode unless `extra` says otherwise). Skips (with a note) where no interposer is built.
fn with_interposer(real: &std::path::Path, extra: &[(&str, &str)], body: impl FnOnce()) {
    if !TCC_INTERPOSER_AVAILABLE {
        eprintln!("skipped: the TCC interposer is built for Linux (glibc) targets only");
        return;
    }
    let interposer = tcc_interposer_path().to_string_lossy().into_owned();
    let real = real.to_string_lossy().into_owned();
    let mut env = vec![
        ("CUDRV_DRIVER_PATH", interposer.as_str()),
        ("CUDRV_TCC_REAL_DRIVER", real.as_str()),
        ("CUDRV_FAKE_MODE", "linux"),
    ];
    env.extend_from_slice(extra);
    run_with_fake(&env, body);
}

/// What every device must look like through the interposer.
fn assert_looks_like_tcc(dev: &Device) {
    assert_eq!(dev.driver_model().unwrap(), DriverModel::Tcc);
    let caps = dev.capabilities().unwrap();
    assert_eq!(caps.driver_model, DriverModel::Tcc);
    assert!(!caps.memory_pools, "the interposer must hide memory pools");
    let choice = memory::choose(dev).unwrap();
    assert_eq!(choice.kind, ResourceKind::StreamOrderedPool, "{}", choice.reason);
    assert!(choice.reason.contains("TCC"), "{}", choice.reason);
}

/// A round trip through a buffer of the device's resource, with a device-to-device copy and a
/// second stream.
fn round_trip(dev: &Device) {
    let s = Stream::new(dev).unwrap();
    let s2 = Stream::new(dev).unwrap();
    let data: Vec<u32> = (0..4096u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    let a = DeviceBuffer::from_slice(&data, &s).unwrap();
    assert_eq!(a.resource().kind(), ResourceKind::StreamOrderedPool);
    let mut b = DeviceBuffer::<u32>::zeroed(data.len(), &s).unwrap();
    b.copy_from(&a).unwrap();
    b.record_use(&s2).unwrap();
    s2.wait_stream(&s).unwrap();
    assert_eq!(b.to_vec().unwrap(), data);
    let mut c = DeviceBuffer::<u32>::zeroed(1000, &s2).unwrap();
    c.fill(0xdead_beef).unwrap();
    assert_eq!(c.to_vec().unwrap(), vec![0xdead_beef; 1000]);
    drop((a, b, c));
    s.synchronize().unwrap();
    s2.synchronize().unwrap();
}

#[test]
fn device_looks_like_tcc_and_allocates_with_the_stream_ordered_pool() {
    with_interposer(&full_fake_driver_path(), &[], || {
        let driver = Driver::global().unwrap();
        assert!(driver.library_path().contains("cudrv_tcc"), "{}", driver.library_path());
        assert!(driver.has_get_proc_address());
        let dev = Device::get(0).unwrap();
        assert_looks_like_tcc(&dev);
        let (resource, choice) = dev.memory_resource_choice().unwrap();
        assert_eq!(choice.kind, ResourceKind::StreamOrderedPool);
        round_trip(&dev);
        resource.trim(0).unwrap();
        dev.primary_context().unwrap().release_cached_events();
        assert_no_leaks();
    });
}

#[test]
fn every_device_looks_like_tcc() {
    with_interposer(&full_fake_driver_path(), &[("CUDRV_FAKE_DEVICES", "linux,wddm,tcc")], || {
        let devices = Device::all().unwrap();
        assert_eq!(devices.len(), 3);
        for dev in &devices {
            assert_looks_like_tcc(dev);
        }
    });
}

#[test]
fn pool_entry_points_return_not_supported() {
    with_interposer(&full_fake_driver_path(), &[], || {
        let driver = Driver::global().unwrap();
        let dev = Device::get(0).unwrap();
        let _ctx = dev.primary_context().unwrap();
        let stream = Stream::new(&dev).unwrap();
        let raw = dev.as_raw();
        let not_supported = Ok(CUresult::CUDA_ERROR_NOT_SUPPORTED);
        let mut pool: CUmemoryPool = std::ptr::null_mut();
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: every pointer is valid for what the call writes; the interposer writes nothing and
        // returns 801, and the handles passed are never dereferenced.
        unsafe {
            assert_eq!(driver.cuDeviceGetMemPool(&mut pool, raw), not_supported);
            assert_eq!(driver.cuDeviceGetDefaultMemPool(&mut pool, raw), not_supported);
            assert_eq!(driver.cuDeviceSetMemPool(raw, pool), not_supported);
            assert_eq!(driver.cuMemAllocAsync(&mut ptr, 256, stream.as_raw()), not_supported);
            assert_eq!(driver.cuMemFreeAsync(ptr, stream.as_raw()), not_supported);
            assert_eq!(driver.cuMemAllocFromPoolAsync(&mut ptr, 256, pool, stream.as_raw()), not_supported);
            assert_eq!(driver.cuMemPoolCreate(&mut pool, std::ptr::null()), not_supported);
            assert_eq!(driver.cuMemPoolTrimTo(pool, 0), not_supported);
            assert_eq!(driver.cuMemPoolDestroy(pool), not_supported);
            assert_eq!(
                driver.cuMemPoolGetAttribute(
                    pool,
                    CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    std::ptr::null_mut()
                ),
                not_supported
            );
            assert_eq!(
                driver.cuMemPoolSetAttribute(
                    pool,
                    CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    std::ptr::null_mut()
                ),
                not_supported
            );
            assert_eq!(driver.cuMemPoolSetAccess(pool, std::ptr::null(), 0), not_supported);
            assert_eq!(driver.cuMemPoolGetAccess(std::ptr::null_mut(), pool, std::ptr::null_mut()), not_supported);
            // Graph memory nodes are the stream-ordered allocator inside graphs: missing too.
            let mut node: cudrv::sys::CUgraphNode = std::ptr::null_mut();
            let mut value: u64 = 0;
            assert_eq!(
                driver.cuGraphAddMemAllocNode(
                    &mut node,
                    std::ptr::null_mut(),
                    std::ptr::null(),
                    0,
                    std::ptr::null_mut()
                ),
                not_supported
            );
            assert_eq!(
                driver.cuGraphAddMemFreeNode(&mut node, std::ptr::null_mut(), std::ptr::null(), 0, ptr),
                not_supported
            );
            assert_eq!(driver.cuDeviceGraphMemTrim(raw), not_supported);
            for attr in [
                cudrv::sys::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT,
                cudrv::sys::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH,
            ] {
                assert_eq!(driver.cuDeviceGetGraphMemAttribute(raw, attr, (&raw mut value).cast()), not_supported);
                assert_eq!(driver.cuDeviceSetGraphMemAttribute(raw, attr, (&raw mut value).cast()), not_supported);
            }
            assert!(node.is_null() && value == 0);
            // The fake has no pool IPC: through the interposer they are as missing as they are there
            // (on a real driver, which has them, they return 801).
            let ipc = [
                driver.cuMemPoolExportPointer(std::ptr::null_mut(), ptr),
                driver.cuMemPoolImportPointer(&mut ptr, pool, std::ptr::null_mut()),
                driver.cuMemPoolExportToShareableHandle(
                    std::ptr::null_mut(),
                    pool,
                    CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
                    0,
                ),
                driver.cuMemPoolImportFromShareableHandle(
                    &mut pool,
                    std::ptr::null_mut(),
                    CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
                    0,
                ),
            ];
            for r in ipc {
                assert!(r == not_supported || r.is_err(), "{r:?}");
            }
        }
        assert!(pool.is_null() && ptr == 0, "the interposer must not write through the pointers");
        // The safe layer reports the missing pools itself, before any driver call.
        let err = memory::DriverPool::default_pool(&dev).unwrap_err();
        assert!(err.is_unsupported(), "{err}");
        drop(stream);
        assert_no_leaks();
    });
}

#[test]
fn other_calls_and_attributes_are_forwarded() {
    with_interposer(&full_fake_driver_path(), &[("CUDRV_FAKE_DRIVER_VERSION", "12080")], || {
        // A driver older than the header: cudrv looks the versioned names (cuMemAlloc_v2, ...) up
        // by their exported names, which the interposer forwards as indirect functions.
        let driver = Driver::global().unwrap();
        assert_eq!(driver.version(), 12080);
        assert_eq!(cudrv::driver_version().unwrap(), 12080);
        let dev = Device::get(0).unwrap();
        assert_looks_like_tcc(&dev);
        assert!(dev.name().unwrap().len() > 1);
        assert!(dev.total_memory().unwrap() > 0);
        assert_eq!(dev.uuid().unwrap().len(), 16);
        round_trip(&dev);
        dev.memory_resource().unwrap().trim(0).unwrap();
        dev.primary_context().unwrap().release_cached_events();
        assert_no_leaks();
    });
}

#[test]
fn exports_mirror_a_driver_without_get_proc_address() {
    // The CUDA 11.1 fake has no cuGetProcAddress and no pools: a dlsym of the interposer must find
    // neither, so that cudrv falls back exactly as it does on that driver.
    with_interposer(&legacy_fake_driver_path(), &[], || {
        let driver = Driver::global().unwrap();
        assert!(!driver.has_get_proc_address());
        assert!(!driver.has("cuMemAllocAsync"));
        assert!(!driver.has("cuDeviceGetMemPool"));
        assert!(driver.has("cuMemAlloc_v2"));
        let dev = Device::get(0).unwrap();
        assert_eq!(dev.driver_model().unwrap(), DriverModel::Tcc);
        assert!(!dev.capabilities().unwrap().memory_pools);
        round_trip(&dev);
        dev.memory_resource().unwrap().trim(0).unwrap();
        dev.primary_context().unwrap().release_cached_events();
        assert_no_leaks();
    });
}

#[test]
fn a_missing_real_driver_is_an_error_not_a_crash() {
    if !TCC_INTERPOSER_AVAILABLE {
        return;
    }
    let interposer = tcc_interposer_path().to_string_lossy().into_owned();
    run_with_fake(
        &[("CUDRV_DRIVER_PATH", interposer.as_str()), ("CUDRV_TCC_REAL_DRIVER", "/nonexistent/libcuda.so.1")],
        || {
            let err = Driver::global().unwrap_err();
            let text = err.to_string();
            assert!(text.contains("cudrv_tcc") && text.contains("303"), "{text}");
        },
    );
}
