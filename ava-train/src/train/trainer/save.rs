//! Saving ([`Trainer::save_checkpoint`]): a checkpoint's files streamed a tensor at a time,
//! with the state other ranks hold sent to rank 0 buffer by buffer, the final model's folder,
//! and the check that the disk has room for the run's last checkpoint.

use super::progress::Counting;
use super::*;

impl Trainer {
    /// Writes a checkpoint of the current step; returns its directory.
    ///
    /// With several ranks every rank calls it: rank 0 writes the whole checkpoint, the
    /// optimizer state of parameters other ranks hold sent by them buffer by buffer (so the
    /// checkpoint is the same whatever the world size and ZeRO stage, and resumes on any).
    pub fn save_checkpoint(&mut self) -> Result<PathBuf, TrainError> {
        let dir = self.store.root().join(crate::save::step_dir_name(self.step));
        if !self.zero.is_root() {
            self.send_state_to_root()?;
            return Ok(dir);
        }
        let trainer = TrainerState {
            step: self.step,
            data_position: self.data_position,
            seed: self.config.train.seed,
            loss_scale: self.scaler,
            micro_batch_split: self.split,
            world_size: self.zero.size(),
        };
        let (hf_config, trainer, config) = (
            json_bytes(&self.model.spec().to_hf_config()),
            json_bytes(&serde_json::to_value(&trainer).expect("serializable")),
            json_bytes(&serde_json::to_value(&self.config).expect("serializable")),
        );
        // The weights and the optimizer state stream into their files a tensor at a time (a
        // streamed state is read back from the tier buffer by buffer): saving holds one
        // tensor's copy, not the model's and the state's.
        let (state, params, zero) = (&self.state, self.model.params(), &self.zero);
        // A buffer another rank holds: rank 0 names it (the file's order is its own), then
        // its owner sends it.
        let mut remote = move |i: usize, j: usize, len: usize| {
            let failed = |e: TrainError| crate::save::SaveError::BadBuffer {
                name: params[i].def.name.clone(),
                reason: format!("receiving it from rank {}: {e}", zero.owner(i)),
            };
            zero.broadcast(&mut state_request(i as u64, j as u64), 0).map_err(failed)?;
            let mut bytes = vec![0u8; len]; // (len,) one buffer
            zero.broadcast(&mut bytes, zero.owner(i)).map_err(failed)?;
            Ok(bytes)
        };
        let mut weights = self.weights_writer();
        // Progress of the two large files, together.
        let total = self.model.params().iter().map(|p| p.stored_bytes() as u64).sum::<u64>() + state.bytes();
        let done = std::cell::Cell::new(0u64);
        let progress = self.io_progress.clone();
        let report = move |bytes: u64| {
            if let Some(f) = &progress {
                (f.0)(&IoProgress { what: "saving", dir: dir.clone(), done: bytes, total });
            }
        };
        let (done, report) = (&done, &report);
        let mut files = vec![
            (HF_CONFIG_FILE.to_string(), FileBody::Bytes(&hf_config)),
            (
                MODEL_FILE.to_string(),
                FileBody::Stream(Box::new(move |out| {
                    weights(&mut Counting { out, done, report, every: IO_PROGRESS_BYTES })
                })),
            ),
            (
                OPTIMIZER_FILE.to_string(),
                FileBody::Stream(Box::new(move |out| {
                    let mut out = Counting { out, done, report, every: IO_PROGRESS_BYTES };
                    state.write_safetensors_gathered(params, &mut out, &mut remote)
                })),
            ),
            (TRAINER_FILE.to_string(), FileBody::Bytes(&trainer)),
            (AVA_CONFIG_FILE.to_string(), FileBody::Bytes(&config)),
        ];
        let dir = self.store.save_files(self.step, &mut files)?;
        if self.zero.stage() >= 1 {
            // The other ranks wait for requests until this one.
            self.zero.broadcast(&mut state_request(u64::MAX, 0), 0)?;
        }
        Ok(dir)
    }

    /// Rank 0's writer of the model's weights (safetensors, a tensor at a time). At ZeRO
    /// stage 3 it asks each other rank's parameters of their owner as it goes (the other
    /// ranks answer in [`send_state_to_root`](Self::send_state_to_root)); rank 0 never
    /// holds more than one of them.
    fn weights_writer(&self) -> impl FnMut(&mut dyn std::io::Write) -> Result<(), crate::save::SaveError> + '_ {
        move |out| {
            if self.zero.stage() < 3 || self.zero.size() == 1 {
                return model::write_tensors(out, &self.model.named_tensors());
            }
            let (params, zero) = (self.model.params(), &self.zero);
            let bad = |i: usize, reason: String| crate::save::SaveError::BadBuffer {
                name: params[i].def.name.clone(),
                reason,
            };
            let specs = params
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    model::tensor_spec(&p.def.name, p.var.dtype(), &p.def.shape).map_err(|e| bad(i, e.to_string()))
                })
                .collect::<Result<Vec<_>, _>>()?;
            model::write_tensors_from(out, &specs, &mut |i| {
                let p = &params[i];
                if zero.owner(i) == zero.rank() {
                    return model::tensor_to_buffer(&p.def.name, p.var.as_tensor())
                        .map(|b| b.data)
                        .map_err(|e| bad(i, e.to_string()));
                }
                let failed = |e: TrainError| bad(i, format!("receiving it from rank {}: {e}", zero.owner(i)));
                zero.broadcast(&mut state_request(i as u64, WEIGHTS_REQUEST), 0).map_err(failed)?;
                let mut bytes = vec![0u8; p.stored_bytes()]; // (numel,) stored type
                zero.broadcast(&mut bytes, zero.owner(i)).map_err(failed)?;
                Ok(bytes)
            })
        }
    }

    /// Writes the trained model's `model/` folder: rank 0 writes it whole; at ZeRO stage 3
    /// the other ranks send it their parameters as it goes.
    /// Writes the final weights as a Hugging Face folder with the run's tokenizer and its
    /// begin- and end-of-text ids (a tokenizer that cannot be written is warned about: the
    /// weights are what the run made).
    pub(super) fn save_final_model(&self, reporter: &mut dyn Reporter) -> Result<Option<PathBuf>, TrainError> {
        let dir = self.out_dir.join("model");
        if !self.zero.is_root() {
            if self.zero.stage() >= 3 {
                self.send_state_to_root()?;
            }
            return Ok(None);
        }
        let mut weights = self.weights_writer();
        let written = model::save_hf_folder_with(&dir, self.model.spec(), &mut weights);
        drop(weights);
        if self.zero.stage() >= 3 && self.zero.size() > 1 {
            // The other ranks wait for requests until this one.
            self.zero.broadcast(&mut state_request(u64::MAX, 0), 0)?;
        }
        written?;
        let tokenizer = crate::inference::run_tokenizer(&self.config)
            .map_err(|e| e.to_string())
            .and_then(|source| crate::inference::write_tokenizer_files(&dir, &source).map_err(|e| e.to_string()));
        if let Err(e) = tokenizer {
            reporter.warn(&format!(
                "{}: the weights are saved, but not the tokenizer ({e}); `ava generate` and transformers need one \
                 beside them: copy it there as tokenizer.json",
                dir.display()
            ));
        }
        Ok(Some(dir))
    }

    /// The other ranks' side of [`save_checkpoint`](Self::save_checkpoint): rank 0 names
    /// each buffer it lacks as it writes the file, and the rank holding it sends it (every
    /// rank takes part in each broadcast) until rank 0 says the file is done. At stage 3
    /// the buffers include the weights ([`WEIGHTS_REQUEST`]).
    fn send_state_to_root(&self) -> Result<(), TrainError> {
        if self.zero.stage() == 0 {
            return Ok(()); // rank 0 holds all of it
        }
        loop {
            let mut request = state_request(0, 0);
            self.zero.broadcast(&mut request, 0)?;
            let (i, j) = (
                u64::from_le_bytes(request[..8].try_into().expect("8 bytes")),
                u64::from_le_bytes(request[8..].try_into().expect("8 bytes")),
            );
            if i == u64::MAX {
                return Ok(());
            }
            if j == WEIGHTS_REQUEST {
                let Some(p) = self.model.params().get(i as usize) else {
                    return Err(TrainError::Invalid(format!(
                        "rank 0 asked for parameter {i}, which does not exist: the ranks disagree on the model"
                    )));
                };
                let owner = self.zero.owner(i as usize);
                let mut bytes = if owner == self.zero.rank() {
                    model::tensor_to_buffer(&p.def.name, p.var.as_tensor())?.data
                } else {
                    vec![0u8; p.stored_bytes()] // (numel,) received and dropped
                };
                self.zero.broadcast(&mut bytes, owner)?;
                continue;
            }
            let (i, j) = (i as usize, j as usize);
            let Some(buffer) = self.state.buffers.get(i).and_then(|b| b.get(j)) else {
                return Err(TrainError::Invalid(format!(
                    "rank 0 asked for optimizer buffer {j} of parameter {i}, which does not exist: the ranks \
                     disagree on the model"
                )));
            };
            let owner = self.zero.owner(i);
            let mut bytes = if owner == self.zero.rank() {
                self.state.buffer_bytes(i, j)?
            } else {
                vec![0u8; buffer.spec.bytes() as usize] // (len,) received and dropped
            };
            self.zero.broadcast(&mut bytes, owner)?;
        }
    }

    /// A run saves at least at its end: a disk without room for that checkpoint is found
    /// before the first step (the tier already holds its records), not after the last. A
    /// disk whose free space cannot be read is left to the save to report.
    pub(super) fn check_checkpoint_room(&self) -> Result<(), TrainError> {
        let weights = (self.model.spec().num_params() * self.model.storage().size_in_bytes()) as u64;
        if let Ok(free) = crate::save::free_space(self.store.root()) {
            crate::save::check_room(self.store.root(), weights, self.state.bytes(), free)?;
        }
        Ok(())
    }

    /// The checkpoint store of this run.
    pub fn store(&self) -> &CheckpointStore {
        &self.store
    }
}

/// The buffer index of a request for a parameter's weights (ZeRO stage 3).
const WEIGHTS_REQUEST: u64 = u64::MAX;

/// Rank 0's request for buffer `j` of parameter `i` while it writes a checkpoint
/// (`u64::MAX`: done; `j` = [`WEIGHTS_REQUEST`]: the weights).
fn state_request(i: u64, j: u64) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&i.to_le_bytes());
    out[8..].copy_from_slice(&j.to_le_bytes());
    out
}

/// Pretty JSON bytes of a value, with a final newline.
fn json_bytes(value: &Value) -> Vec<u8> {
    let mut v = serde_json::to_vec_pretty(value).expect("a JSON value serializes");
    v.push(b'\n');
    v
}
