//! The optimizer state in checkpoints: written as safetensors a buffer at a time (a streamed
//! buffer read from its tier when its turn comes), and loaded back with every mismatch against
//! the optimizer's layout reported at once.

use super::*;

impl OptimizerState {
    /// Writes the state as a safetensors file of buffers named `{param}.{buffer}` (what
    /// [`load_buffers`](Self::load_buffers) reads), one buffer at a time: a streamed buffer is read from the tier when its turn
    /// comes and freed once written, so a state larger than memory can be saved.
    pub fn write_safetensors(&self, params: &[Param], out: &mut dyn std::io::Write) -> Result<(), SaveError> {
        self.write_safetensors_gathered(params, out, &mut |i, j, _| {
            Err(SaveError::BadBuffer {
                name: format!("{}.{}", params[i].def.name, self.buffers[i][j].spec.name),
                reason: "another rank holds this buffer".into(),
            })
        })
    }

    /// [`write_safetensors`](Self::write_safetensors) of the whole state when this process
    /// holds only its ZeRO share: a buffer another rank holds comes from
    /// `remote(param, buffer, bytes)`, called in file order.
    pub fn write_safetensors_gathered(
        &self,
        params: &[Param],
        out: &mut dyn std::io::Write,
        remote: &mut dyn FnMut(usize, usize, usize) -> Result<Vec<u8>, SaveError>,
    ) -> Result<(), SaveError> {
        let mut at = Vec::new(); // (parameter, buffer) of each spec
        let mut specs = Vec::new();
        for (i, (p, bufs)) in params.iter().zip(&self.buffers).enumerate() {
            for (j, b) in bufs.iter().enumerate() {
                at.push((i, j));
                specs.push(TensorSpec {
                    name: format!("{}.{}", p.def.name, b.spec.name),
                    dtype: buf_dtype(b.spec.dtype),
                    shape: vec![b.spec.len as usize],
                });
            }
        }
        crate::save::write_safetensors(out, &specs, None, &mut |k| {
            let (i, j) = at[k];
            let b = &self.buffers[i][j];
            if !self.held[i] {
                return remote(i, j, b.spec.bytes() as usize).map(std::borrow::Cow::Owned);
            }
            match &self.home {
                Home::Tier(s) if s.offloaded[i] => {
                    let mut bytes = vec![0u8; b.spec.bytes() as usize]; // (len · size,) one buffer
                    s.tier.get(&s.keys[i][j], &mut bytes).map_err(|e| SaveError::BadBuffer {
                        name: specs[k].name.clone(),
                        reason: tier_error(&s.name, &format!("reading {}", s.keys[i][j]), e).to_string(),
                    })?;
                    Ok(std::borrow::Cow::Owned(bytes))
                }
                _ => b.bytes().map_err(|e| SaveError::BadBuffer { name: specs[k].name.clone(), reason: e.to_string() }),
            }
        })?;
        Ok(())
    }

    /// Fills the state from a checkpoint's buffers; every buffer of the plugin's layout must
    /// be there with the declared type and length. Streamed state goes to the tier. The
    /// engine's own buffers may be missing (a checkpoint of another `train.master_weights`,
    /// resumed with --force: they keep their initial values, f32 masters the weights
    /// widened); a saved master this run has no buffer for is returned, for the caller to
    /// take the weights from.
    pub fn load_buffers(
        &mut self,
        params: &[Param],
        saved: Vec<BufferView<'_>>,
        progress: &mut dyn FnMut(u64),
    ) -> Result<Vec<NamedBuffer>, TrainError> {
        let mut loaded = 0u64;
        let mut by_name: std::collections::HashMap<String, BufferView<'_>> =
            saved.into_iter().map(|b| (b.name.clone(), b)).collect();
        let mut problems = StateProblems::default();
        for (i, (p, bufs)) in params.iter().zip(&mut self.buffers).enumerate() {
            for (j, b) in bufs.iter_mut().enumerate() {
                let name = format!("{}.{}", p.def.name, b.spec.name);
                if !self.held[i] {
                    // Another rank's: it loads these itself.
                    by_name.remove(&name);
                    continue;
                }
                match by_name.remove(&name) {
                    None if b.host => {}
                    None => problems.add("missing", &b.spec.name, &name),
                    Some(s) if s.dtype != buf_dtype(b.spec.dtype) || s.data.len() != b.spec.bytes() as usize => {
                        problems.add(
                            &format!(
                                "of another type or size ({} × {} bytes saved, {} × {} declared)",
                                s.dtype.name(),
                                s.data.len(),
                                b.spec.dtype.as_str(),
                                b.spec.bytes()
                            ),
                            &b.spec.name,
                            &name,
                        )
                    }
                    Some(saved) => {
                        match &self.home {
                            Home::Tier(st) if st.offloaded[i] => {
                                let k = &st.keys[i][j];
                                st.tier
                                    .put(k, saved.data, b.spec.dtype)
                                    .map_err(|e| tier_error(&st.name, &format!("storing {k}"), e))?;
                            }
                            _ => b.bytes_mut().copy_from_slice(saved.data),
                        }
                        loaded += saved.data.len() as u64;
                        progress(loaded);
                    }
                }
            }
        }
        let host = |k: &str| k.ends_with(&format!(".{MASTER}")) || k.ends_with(&format!(".{COMPENSATION}"));
        let (left, unexpected): (Vec<BufferView<'_>>, Vec<BufferView<'_>>) =
            by_name.into_values().partition(|b| host(&b.name));
        for b in unexpected {
            // The buffer's own name: what follows the parameter it belongs to.
            let owner = params
                .iter()
                .map(|p| &p.def.name)
                .filter(|n| b.name.starts_with(&format!("{n}.")))
                .max_by_key(|n| n.len());
            let buffer = owner.map_or(b.name.as_str(), |n| &b.name[n.len() + 1..]);
            problems.add("unexpected (the optimizer has no such buffer)", buffer, &b.name);
        }
        if !problems.is_empty() {
            return Err(TrainError::OptimizerState { problems: problems.lines(), trained_with: None, file: None });
        }
        if let Home::Tier(st) = &self.home {
            st.tier.flush().map_err(|e| tier_error(&st.name, "writing the optimizer state", e))?;
        }
        Ok(left
            .into_iter()
            .filter(|b| b.name.ends_with(&format!(".{MASTER}")))
            .map(|b| NamedBuffer { name: b.name, dtype: b.dtype, shape: b.shape, data: b.data.to_vec() })
            .collect())
    }
}

fn buf_dtype(d: StateDType) -> BufDType {
    match d {
        StateDType::F32 => BufDType::F32,
        StateDType::F64 => BufDType::F64,
        StateDType::U32 => BufDType::U32,
        StateDType::F16 => BufDType::F16,
        StateDType::BF16 => BufDType::BF16,
        // Saved as raw bytes; read back the same way.
        StateDType::U8 | StateDType::I8 => BufDType::U8,
    }
}

/// Mismatches between a checkpoint's optimizer state and the optimizer's layout, grouped by
/// what is wrong and the buffer's own name (`exp_avg`, `step`), so a change of optimizer reads
/// as a few lines rather than one per tensor.
#[derive(Default)]
struct StateProblems {
    /// (what, buffer) → (how many, the first full name).
    groups: std::collections::BTreeMap<(String, String), (usize, String)>,
}

impl StateProblems {
    fn add(&mut self, what: &str, buffer: &str, name: &str) {
        let e = self.groups.entry((what.to_string(), buffer.to_string())).or_insert((0, name.to_string()));
        e.0 += 1;
    }

    fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// `missing exp_avg: 22 tensors (e.g. lm_head.weight.exp_avg)`, one line per group.
    fn lines(&self) -> Vec<String> {
        self.groups
            .iter()
            .map(|((what, buffer), (n, first))| match n {
                1 => format!("{what} {buffer}: {first}"),
                _ => format!("{what} {buffer}: {n} tensors (e.g. {first})"),
            })
            .collect()
    }
}
