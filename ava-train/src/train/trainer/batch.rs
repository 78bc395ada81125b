//! A batch as the micro-batches a step's forward and backward passes read: the tokens on the
//! model's device, the targets and the packed documents on the host.

use super::*;

/// What one forward/backward pass reads: (B, T) input ids, the flat targets, and the
/// packed documents (`data.packing: document`).
pub(super) struct MicroBatch {
    pub(super) tokens: Tensor,
    pub(super) targets: Vec<u32>,
    pub(super) documents: Option<Documents>,
}

/// A batch as one micro-batch, its tokens on `device`.
pub(super) fn tensors(batch: &Batch, device: &Device) -> Result<MicroBatch, TrainError> {
    Ok(split_batch(batch, 1, device)?.pop().expect("one piece"))
}

/// A batch split into `pieces` equal micro-batches (the memory policy's shrink). Each
/// piece's packed documents are copied from the batch's rows directly, so they are held
/// once: B·T ids and positions over all the pieces. The tokens go to `device` (the model's);
/// the targets and documents stay on the host, where the ops that take them read them.
pub(super) fn split_batch(batch: &Batch, pieces: usize, device: &Device) -> Result<Vec<MicroBatch>, TrainError> {
    let (inputs, targets, positions) = (batch.inputs(), batch.targets(), batch.positions());
    let rows = batch.batch_size / pieces;
    let per = rows * batch.seq_len;
    (0..pieces)
        .map(|i| {
            let span = i * per..(i + 1) * per;
            let tokens = Tensor::from_vec(inputs[span.clone()].to_vec(), (rows, batch.seq_len), device); // (B, T)
            let documents = match (&batch.segments, &positions) {
                (Some(segments), Some(positions)) => Some(
                    Documents::new(
                        rows,
                        batch.seq_len,
                        segments[span.clone()].to_vec(),
                        positions[span.clone()].to_vec(),
                    )
                    .map_err(TrainError::candle)?,
                ),
                _ => None,
            };
            Ok(MicroBatch { tokens: tokens.map_err(TrainError::candle)?, targets: targets[span].to_vec(), documents })
        })
        .collect()
}

#[cfg(test)]
mod split_tests {
    use super::*;

    /// Split by the memory policy, each micro-batch of a packed batch holds its rows' tokens,
    /// targets, document ids and positions: together, the whole batch's.
    #[test]
    fn split_pieces_hold_their_rows_documents() {
        let (b, t) = (4, 3);
        let tokens: Vec<u32> = (0..(b * (t + 1)) as u32).collect();
        let segments = vec![0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 1, 2];
        let batch = Batch { index: 0, batch_size: b, seq_len: t, tokens, segments: Some(segments.clone()) };
        let whole = tensors(&batch, &Device::Cpu).unwrap();
        let docs = whole.documents.as_ref().unwrap();
        assert_eq!(&**docs.segments(), &segments[..]);
        assert_eq!(&**docs.positions(), &[0, 1, 0, 0, 0, 1, 0, 1, 2, 0, 0, 0][..]);
        let pieces = split_batch(&batch, 2, &Device::Cpu).unwrap();
        for (i, piece) in pieces.iter().enumerate() {
            let rows = i * 2 * t..(i + 1) * 2 * t;
            assert_eq!(piece.tokens.to_vec2::<u32>().unwrap().concat(), batch.inputs()[rows.clone()]);
            assert_eq!(piece.targets, batch.targets()[rows.clone()]);
            let d = piece.documents.as_ref().unwrap();
            assert_eq!(d.dims(), (2, t));
            assert_eq!(&**d.segments(), &docs.segments()[rows.clone()]);
            assert_eq!(&**d.positions(), &docs.positions()[rows]);
        }
        let plain = Batch { segments: None, ..batch };
        assert!(split_batch(&plain, 2, &Device::Cpu).unwrap().iter().all(|p| p.documents.is_none()));
    }
}
