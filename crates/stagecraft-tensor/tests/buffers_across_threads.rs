//! Buffers allocated on one thread and freed on another go to the freeing
//! thread's cache or the shared pool and are handed out again elsewhere; a
//! thread's cache is freed when the thread ends. Small enough for Miri
//! (`scripts/miri.sh`), which checks the raw pointer handling, the
//! `Send`/`Sync` claims and the thread-local destructors.

use stagecraft_tensor::Buffer;

/// Below and above the size where blocks go to the shared pool (4 KiB).
const SIZES: [usize; 4] = [48, 96, 4096, 4096 + 64];

#[test]
fn buffers_cross_threads_through_the_caches_and_the_pool() {
    let (to_consumer, inbox) = std::sync::mpsc::channel::<(usize, Buffer)>();
    let producers: Vec<_> = (0..3i32)
        .map(|t| {
            let to_consumer = to_consumer.clone();
            std::thread::spawn(move || {
                for (i, &len) in SIZES.iter().enumerate() {
                    let mut b = Buffer::zeroed(len);
                    b.typed_mut::<i32>().unwrap().fill(t * 16 + i as i32);
                    to_consumer.send((len, b.clone())).unwrap();
                    // This thread's reference goes away while the consumer
                    // may still be reading.
                    drop(b);
                    // A reused block is zeroed again on request.
                    let again = Buffer::zeroed(len);
                    assert!(again.bytes().iter().all(|&x| x == 0));
                }
            })
        })
        .collect();
    drop(to_consumer);
    let consumer = std::thread::spawn(move || {
        let mut seen = 0;
        for (len, b) in inbox {
            assert_eq!(b.len(), len);
            let values = b.typed::<i32>().unwrap();
            assert!(values.iter().all(|&x| x == values[0]));
            seen += 1;
            // Freed here: into this thread's cache or the shared pool.
        }
        seen
    });
    for p in producers {
        p.join().unwrap();
    }
    assert_eq!(consumer.join().unwrap(), 3 * SIZES.len());
    // Blocks freed on other threads are reusable here, and `for_overwrite`
    // hands out initialised (if stale) bytes.
    for len in SIZES {
        let b = Buffer::for_overwrite(len);
        assert_eq!(b.bytes().len(), len);
        let _sum: u32 = b.bytes().iter().map(|&x| x as u32).sum();
    }
    Buffer::trim_pool();
}
