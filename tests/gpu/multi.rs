//! Several GPUs (`--features gpu`, needs two devices; with one it says so and passes nothing
//! else): per-device resources, peer access, and 1 GiB peer copies both ways, checked.

use cudrv::memory::DeviceBuffer;
use cudrv::{Device, Error, Stream};
use cudrv_test_support::run_in_own_process;

fn two() -> Option<(Device, Device)> {
    let all = Device::all().unwrap();
    if all.len() < 2 {
        println!("only {} device(s): the multi-GPU tests need two", all.len());
        return None;
    }
    Some((all[0], all[1]))
}

#[test]
fn each_device_has_its_own_resource_and_statistics() {
    // In a process of its own: the devices' resources are the process's, and the tests beside it
    // allocate from them too.
    run_in_own_process(each_device_has_its_own_resource_and_statistics_body);
}

fn each_device_has_its_own_resource_and_statistics_body() {
    let Some((d0, d1)) = two() else { return };
    let r0 = d0.memory_resource().unwrap();
    let r1 = d1.memory_resource().unwrap();
    assert_eq!(r0.device(), d0);
    assert_eq!(r1.device(), d1);
    let s0 = Stream::new(&d0).unwrap();
    let s1 = Stream::new(&d1).unwrap();
    // A stream of one device cannot allocate from the other's resource.
    assert!(matches!(r1.allocate(16, &s0), Err(Error::DeviceMismatch { .. })));
    let a = DeviceBuffer::<u8>::zeroed(64 << 20, &s0).unwrap();
    let b = DeviceBuffer::<u8>::zeroed(16 << 20, &s1).unwrap();
    let (st0, st1) = (r0.stats().unwrap(), r1.stats().unwrap());
    assert!(st0.in_use >= 64 << 20, "{st0:?}");
    assert!(st1.in_use >= 16 << 20 && st1.in_use < 64 << 20, "{st1:?}");
    drop((a, b));
}

#[test]
fn peer_copies_of_1_gib_both_ways() {
    let Some((d0, d1)) = two() else { return };
    let n = 1usize << 30;
    let s0 = Stream::new(&d0).unwrap();
    let s1 = Stream::new(&d1).unwrap();
    let mut pattern: Vec<u32> = Vec::with_capacity(n / 4);
    let mut x = 0x1234_5678u32;
    for _ in 0..n / 4 {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        pattern.push(x);
    }
    for enable in [false, true] {
        if enable {
            if !d0.can_access_peer(&d1).unwrap() {
                println!("no peer access between devices 0 and 1: copies go through the host");
                continue;
            }
            d0.enable_peer_access(&d1).unwrap();
            d1.enable_peer_access(&d0).unwrap();
            d0.enable_peer_access(&d1).unwrap(); // idempotent
        }
        let src = DeviceBuffer::from_slice(&pattern, &s0).unwrap();
        let mut on1 = DeviceBuffer::<u32>::zeroed(n / 4, &s1).unwrap();
        s0.wait_stream(&s1).unwrap();
        src.copy_to_peer(&mut on1, &s0).unwrap();
        let mut back = DeviceBuffer::<u32>::zeroed(n / 4, &s0).unwrap();
        s1.wait_stream(&s0).unwrap();
        on1.copy_to_peer(&mut back, &s1).unwrap();
        s0.wait_stream(&s1).unwrap();
        let got = back.to_vec().unwrap();
        let bad = got.iter().zip(&pattern).filter(|(a, b)| a != b).count();
        assert_eq!(bad, 0, "peer access {enable}: {bad} words differ after 0 -> 1 -> 0");
        s1.synchronize().unwrap();
        let on1_host = on1.view(n / 4 - 4096..).unwrap().to_vec().unwrap();
        assert_eq!(on1_host, &pattern[n / 4 - 4096..]);
    }
}
