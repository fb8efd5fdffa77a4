//! A memory resource slowed down, for tests that need another thread's allocation under way:
//! it holds the stream's gate meanwhile, as every allocation of a `DeviceBuffer` from a resource
//! other than cudrv's pool does. The tests wait until it has begun ([`under_way`]) instead of
//! betting on a head start.

use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudrv::memory::{DevicePtr, MemoryResource, ResourceKind};
use cudrv::{Device, Stream};

/// `inner`, whose allocations take `pause` longer, and tell when they begin.
#[derive(Debug)]
pub(crate) struct Slowed<R> {
    inner: R,
    pause: Duration,
    /// Told when an allocation begins (inside `allocate`: under the stream's gate).
    began: Mutex<Sender<()>>,
}

/// `inner` slowed by `pause` an allocation, and what tells when one is under way.
pub(crate) fn slowed<R: MemoryResource>(inner: R, pause: Duration) -> (Arc<Slowed<R>>, Receiver<()>) {
    let (tx, rx) = std::sync::mpsc::channel();
    (Arc::new(Slowed { inner, pause, began: Mutex::new(tx) }), rx)
}

/// Waits until an allocation of a [`Slowed`] resource is under way.
pub(crate) fn under_way(began: &Receiver<()>) {
    began.recv_timeout(Duration::from_secs(30)).expect("the allocation began");
}

// SAFETY: every pointer is `inner`'s, handed out and taken back as it came.
unsafe impl<R: MemoryResource> MemoryResource for Slowed<R> {
    fn allocate(&self, bytes: usize, stream: &Stream) -> cudrv::Result<DevicePtr> {
        let _ = self.began.lock().unwrap().send(());
        std::thread::sleep(self.pause);
        self.inner.allocate(bytes, stream)
    }
    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> cudrv::Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.inner.deallocate(ptr, bytes, stream) }
    }
    fn device(&self) -> Device {
        self.inner.device()
    }
    fn kind(&self) -> ResourceKind {
        ResourceKind::Custom
    }
    fn supports_capture(&self) -> bool {
        self.inner.supports_capture()
    }
}
