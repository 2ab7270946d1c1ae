//! Primitive costs on Open MPI over shared memory, 2 processes:
//! blocking MPI_Allreduce, MPI_Iallreduce + test loop, and all-reduces
//! built on non-blocking point-to-point messages (see README.md).
//!
//! A throwaway measurement, not runtime code: the raw MPI calls below are
//! `unsafe` without per-block safety comments; every buffer they are
//! given outlives the loop iteration that completes its request.
use mpi::ffi;
use std::os::raw::c_int;
use std::time::Instant;

unsafe fn test_until(req: &mut ffi::MPI_Request) {
    let mut flag: c_int = 0;
    while flag == 0 {
        ffi::MPI_Test(req, &mut flag, ffi::RSMPI_STATUS_IGNORE);
    }
}

fn main() {
    let (_u, _t) = mpi::initialize_with_threading(mpi::Threading::Serialized).unwrap();
    let (mut rank, mut size) = (0, 0);
    unsafe {
        ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut rank);
        ffi::MPI_Comm_size(ffi::RSMPI_COMM_WORLD, &mut size);
    }
    let comm = unsafe { ffi::RSMPI_COMM_WORLD };
    let other = 1 - rank;
    for (bytes, iters) in [(1024usize, 4000usize), (4usize << 10, 4000usize), (8 << 10, 4000), (16 << 10, 2000), (64 << 10, 1000), (256 << 10, 400), (1 << 20, 200), (64 << 20, 6)] {
        let n = bytes / 4;
        let x = vec![1.0f32; n];
        let mut y = vec![0.0f32; n];
        let mut msg = vec![0u8; bytes + 32];
        let mut inbox = vec![0u8; bytes + 32];
        let mut res = [Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new()];
        for _round in 0..5 {
            unsafe {
                ffi::MPI_Barrier(comm);
                let t = Instant::now();
                for _ in 0..iters {
                    ffi::MPI_Allreduce(x.as_ptr().cast(), y.as_mut_ptr().cast(), n as c_int, ffi::RSMPI_FLOAT, ffi::RSMPI_SUM, comm);
                }
                res[0].push(t.elapsed().as_secs_f64() / iters as f64);
                ffi::MPI_Barrier(comm);
                let t = Instant::now();
                for _ in 0..iters {
                    let mut req = ffi::RSMPI_REQUEST_NULL;
                    ffi::MPI_Iallreduce(x.as_ptr().cast(), y.as_mut_ptr().cast(), n as c_int, ffi::RSMPI_FLOAT, ffi::RSMPI_SUM, comm, &mut req);
                    test_until(&mut req);
                }
                res[1].push(t.elapsed().as_secs_f64() / iters as f64);
                // pre-posted Irecv with known size, message = header + data
                ffi::MPI_Barrier(comm);
                let t = Instant::now();
                for _ in 0..iters {
                    let mut rr = ffi::RSMPI_REQUEST_NULL;
                    let mut sr = ffi::RSMPI_REQUEST_NULL;
                    ffi::MPI_Irecv(inbox.as_mut_ptr().cast(), (bytes + 32) as c_int, ffi::RSMPI_UINT8_T, other, 5, comm, &mut rr);
                    std::ptr::copy_nonoverlapping(x.as_ptr().cast::<u8>(), msg.as_mut_ptr().add(32), bytes);
                    ffi::MPI_Isend(msg.as_ptr().cast(), (bytes + 32) as c_int, ffi::RSMPI_UINT8_T, other, 5, comm, &mut sr);
                    test_until(&mut rr);
                    let theirs: &[f32] = std::slice::from_raw_parts(inbox.as_ptr().add(32).cast(), n);
                    for i in 0..n { y[i] = x[i] + theirs[i]; }
                    test_until(&mut sr);
                }
                res[2].push(t.elapsed().as_secs_f64() / iters as f64);
                // Improbe + Imrecv (size unknown), two messages: header then data
                ffi::MPI_Barrier(comm);
                let t = Instant::now();
                for _ in 0..iters {
                    let mut sr = ffi::RSMPI_REQUEST_NULL;
                    let mut hr = ffi::RSMPI_REQUEST_NULL;
                    ffi::MPI_Isend(msg.as_ptr().cast(), 32, ffi::RSMPI_UINT8_T, other, 6, comm, &mut hr);
                    ffi::MPI_Isend(x.as_ptr().cast(), bytes as c_int, ffi::RSMPI_UINT8_T, other, 6, comm, &mut sr);
                    let mut hdr = [0u8; 32];
                    ffi::MPI_Recv(hdr.as_mut_ptr().cast(), 32, ffi::RSMPI_UINT8_T, other, 6, comm, ffi::RSMPI_STATUS_IGNORE);
                    let mut flag = 0;
                    let mut h: ffi::MPI_Message = ffi::RSMPI_MESSAGE_NULL;
                    let mut st: ffi::MPI_Status = std::mem::zeroed();
                    while flag == 0 {
                        ffi::MPI_Improbe(other, 6, comm, &mut flag, &mut h, &mut st);
                    }
                    let mut rr = ffi::RSMPI_REQUEST_NULL;
                    ffi::MPI_Imrecv(inbox.as_mut_ptr().cast(), bytes as c_int, ffi::RSMPI_UINT8_T, &mut h, &mut rr);
                    test_until(&mut rr);
                    let theirs: &[f32] = std::slice::from_raw_parts(inbox.as_ptr().cast(), n);
                    for i in 0..n { y[i] = x[i] + theirs[i]; }
                    test_until(&mut sr);
                    test_until(&mut hr);
                }
                res[3].push(t.elapsed().as_secs_f64() / iters as f64);
                // Irecv straight into a buffer, sum in place: split halves (reduce-scatter + allgather) 
                ffi::MPI_Barrier(comm);
                let t = Instant::now();
                for _ in 0..iters {
                    // exchange halves: I own half `rank`
                    let half = n / 2;
                    let (mine, theirs_off) = if rank == 0 { (0, half) } else { (half, 0) };
                    let mut rr = ffi::RSMPI_REQUEST_NULL;
                    let mut sr = ffi::RSMPI_REQUEST_NULL;
                    ffi::MPI_Irecv(inbox.as_mut_ptr().cast(), half as c_int, ffi::RSMPI_FLOAT, other, 7, comm, &mut rr);
                    ffi::MPI_Isend(x.as_ptr().add(theirs_off).cast(), half as c_int, ffi::RSMPI_FLOAT, other, 7, comm, &mut sr);
                    test_until(&mut rr);
                    let got: &[f32] = std::slice::from_raw_parts(inbox.as_ptr().cast(), half);
                    for i in 0..half { y[mine + i] = x[mine + i] + got[i]; }
                    test_until(&mut sr);
                    ffi::MPI_Irecv(y.as_mut_ptr().add(theirs_off).cast(), half as c_int, ffi::RSMPI_FLOAT, other, 8, comm, &mut rr);
                    ffi::MPI_Isend(y.as_ptr().add(mine).cast(), half as c_int, ffi::RSMPI_FLOAT, other, 8, comm, &mut sr);
                    test_until(&mut rr);
                    test_until(&mut sr);
                }
                res[4].push(t.elapsed().as_secs_f64() / iters as f64);
                // One round: the whole vector (and a 16-byte check) in
                // fragments of at most 4000 bytes, each eager.
                ffi::MPI_Barrier(comm);
                let t = Instant::now();
                let total = bytes + 16;
                let frags = total.div_ceil(4000);
                let frag = total.div_ceil(frags);
                for _ in 0..iters {
                    if total > 1 << 16 { break; }
                    let mut reqs = Vec::with_capacity(2 * frags);
                    for f in 0..frags {
                        let lo = f * frag; let hi = (lo + frag).min(total);
                        let mut r = ffi::RSMPI_REQUEST_NULL;
                        ffi::MPI_Irecv(inbox.as_mut_ptr().add(lo).cast(), (hi - lo) as c_int, ffi::RSMPI_UINT8_T, other, 9, comm, &mut r);
                        reqs.push(r);
                    }
                    std::ptr::copy_nonoverlapping(x.as_ptr().cast::<u8>(), msg.as_mut_ptr().add(16), bytes);
                    for f in 0..frags {
                        let lo = f * frag; let hi = (lo + frag).min(total);
                        let mut r = ffi::RSMPI_REQUEST_NULL;
                        ffi::MPI_Isend(msg.as_ptr().add(lo).cast(), (hi - lo) as c_int, ffi::RSMPI_UINT8_T, other, 9, comm, &mut r);
                        reqs.push(r);
                    }
                    for r in reqs.iter_mut() { test_until(r); }
                    let theirs: &[f32] = std::slice::from_raw_parts(inbox.as_ptr().add(16).cast(), n);
                    for i in 0..n { y[i] = x[i] + theirs[i]; }
                }
                res[5].push(t.elapsed().as_secs_f64() / iters as f64);
                // As stagecraft's exchange cuts it: a first fragment of at
                // most 4000 bytes, the rest after it; the later receives
                // posted only once the first has arrived (and its check
                // was read).
                ffi::MPI_Barrier(comm);
                let t = Instant::now();
                for _ in 0..iters {
                    if total > 1 << 16 { break; }
                    let first = total.min(4000);
                    let mut rr = [ffi::RSMPI_REQUEST_NULL; 2];
                    let mut sr = [ffi::RSMPI_REQUEST_NULL; 2];
                    ffi::MPI_Irecv(inbox.as_mut_ptr().cast(), first as c_int, ffi::RSMPI_UINT8_T, other, 11, comm, &mut rr[0]);
                    std::ptr::copy_nonoverlapping(x.as_ptr().cast::<u8>(), msg.as_mut_ptr().add(16), bytes);
                    ffi::MPI_Isend(msg.as_ptr().cast(), first as c_int, ffi::RSMPI_UINT8_T, other, 11, comm, &mut sr[0]);
                    if total > first {
                        ffi::MPI_Isend(msg.as_ptr().add(first).cast(), (total - first) as c_int, ffi::RSMPI_UINT8_T, other, 11, comm, &mut sr[1]);
                    }
                    test_until(&mut rr[0]);
                    if total > first {
                        ffi::MPI_Irecv(inbox.as_mut_ptr().add(first).cast(), (total - first) as c_int, ffi::RSMPI_UINT8_T, other, 11, comm, &mut rr[1]);
                        test_until(&mut rr[1]);
                    }
                    let mut flag = 0;
                    while flag == 0 { ffi::MPI_Testall(2, sr.as_mut_ptr(), &mut flag, ffi::RSMPI_STATUSES_IGNORE); }
                    let theirs: &[f32] = std::slice::from_raw_parts(inbox.as_ptr().add(16).cast(), n);
                    for i in 0..n { y[i] = x[i] + theirs[i]; }
                }
                res[6].push(t.elapsed().as_secs_f64() / iters as f64);
            }
        }
        if rank == 0 {
            let med: Vec<f64> = res.iter_mut().map(|r| { r.sort_by(f64::total_cmp); r[2] * 1e6 }).collect();
            println!("{:>9} B  allreduce {:8.2} us  iallreduce {:8.2}  p2p-one-msg {:8.2}  p2p-hdr+probe {:8.2}  p2p-halves {:8.2}  one-round-frags {:8.2}  late-frags {:8.2}", bytes, med[0], med[1], med[2], med[3], med[4], med[5], med[6]);
        }
    }
}
