//! Checks every collective of the process group this program is launched in, and prints one
//! line per rank. Run it as `mpirun -np 3 collectives` in a build with `--features mpi`
//! (aligner's tests do); alone it checks the one-process group.

use std::time::Duration;

use aligner_parallel::{ReduceOp, launch, world};

fn main() {
    let _launch = launch().expect("start the process group");
    let comm = world();
    let (rank, size) = (comm.rank(), comm.world_size());

    let mut buf = vec![rank as f32, 1.0, -(rank as f32)];
    comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
    let rank_sum = (size * (size - 1) / 2) as f32;
    assert_eq!(buf, vec![rank_sum, size as f32, -rank_sum], "sum");
    let mut buf = vec![rank as f32 * 2.0];
    comm.all_reduce(&mut buf, ReduceOp::Mean).unwrap();
    assert_eq!(buf[0], (size - 1) as f32, "mean");
    let mut wide = vec![rank as f64 + 0.5];
    comm.all_reduce_f64(&mut wide, ReduceOp::Max).unwrap();
    assert_eq!(wide[0], size as f64 - 0.5, "max");

    let mut bytes = if rank == size - 1 {
        b"from the last rank".to_vec()
    } else {
        Vec::new()
    };
    comm.broadcast(&mut bytes, size - 1).unwrap();
    assert_eq!(bytes, b"from the last rank", "broadcast");

    // Ragged: rank r sends r bytes (rank 0 sends none).
    let mine = vec![rank as u8; rank];
    let all = comm.all_gather(&mine).unwrap();
    assert_eq!(all.len(), size);
    for (r, got) in all.iter().enumerate() {
        assert_eq!(got, &vec![r as u8; r], "all-gather from rank {r}");
    }
    // The same parts gathered on the last rank alone: the others receive nothing.
    let root = size - 1;
    match comm.gather(&mine, root).unwrap() {
        Some(all) => {
            assert_eq!(rank, root, "rank {rank} received a gather to rank {root}");
            for (r, got) in all.iter().enumerate() {
                assert_eq!(got, &vec![r as u8; r], "gather from rank {r}");
            }
        }
        None => assert_ne!(rank, root, "the root received nothing"),
    }

    // Rank 1 is slow, so the others take more of the queue; every item is handed out once.
    let items = 40;
    for round in 0..2 {
        let mut queue = comm.work_queue(items, 3).unwrap();
        let mut taken = Vec::new();
        while let Some(chunk) = queue.next_chunk().unwrap() {
            let ms = if rank == 1 { 20 } else { 2 };
            std::thread::sleep(Duration::from_millis(ms));
            taken.extend(chunk);
        }
        drop(queue);
        let encoded: Vec<u8> = taken.iter().map(|&i| i as u8).collect();
        let mut all: Vec<usize> = comm
            .all_gather(&encoded)
            .unwrap()
            .into_iter()
            .flatten()
            .map(usize::from)
            .collect();
        all.sort();
        assert_eq!(all, (0..items).collect::<Vec<_>>(), "queue round {round}");
        println!(
            "rank {rank}/{size}: queue round {round} took {} of {items} items",
            taken.len()
        );
        if size > 2 && rank == 1 {
            assert!(
                taken.len() < items / size,
                "the slow rank took its even share or more"
            );
        }
    }
    comm.barrier().unwrap();
    let traffic = comm.traffic();
    println!(
        "rank {rank}/{size}: collectives ok ({} all-reduces, {} bytes)",
        traffic.calls, traffic.bytes
    );
}
