//! Builds a `CanonicalPrompt` from text ids and fingerprinted items, either
//! piece by piece or from a whole id sequence whose placeholders are expanded
//! (one pad per item token) or unexpanded (one pad per item).

use std::sync::Arc;

use crate::canon::{ItemIdentity, Modality};
use crate::error::{RequestError, Result};

use super::mrope::{PositionKind, audio_in_video_runs, positions_from_atoms};
use super::{Atom, CanonicalPrompt, IndexMap, ItemSpan, OmniTokens, TenantSalt};

/// Accumulates atoms, token ids and the index map of one prompt.
///
/// Every `push_*` / `extend` either applies completely or returns an error
/// and leaves the builder unchanged.
///
/// ```
/// use std::sync::Arc;
/// use omniprefix::canon::{Evidence, Fingerprint, ItemIdentity, ItemLayout, Modality};
/// use omniprefix::prompt::{OmniTokens, PlaceholderForm, PromptBuilder};
///
/// let image = Arc::new(ItemIdentity {
///     fingerprint: Fingerprint(7),
///     evidence: Evidence::Unvalidated,
///     modality: Modality::Image,
///     layout: ItemLayout::Image { grid_thw: [1, 4, 6] },
///     num_tokens: 6,
///     content_bytes: 0,
/// });
/// let tokens = OmniTokens::tiny();
/// let mut builder = PromptBuilder::new(tokens.clone());
/// // Unexpanded: one image pad stands for the whole image.
/// builder.extend(&[100, 503, 500, 504, 200], &[image], PlaceholderForm::Unexpanded)?;
/// let prompt = builder.build()?;
/// assert_eq!(prompt.len(), 10);
/// assert_eq!(prompt.index_map.placeholders.len(), 6);
/// assert_eq!(prompt.positions.rope_delta(), Some(-3));
/// # Ok::<(), omniprefix::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct PromptBuilder {
    tokens: OmniTokens,
    tenant: TenantSalt,
    kind: PositionKind,
    atoms: Vec<Atom>,
    token_ids: Vec<u32>,
    items: Vec<Arc<ItemIdentity>>,
    index_map: IndexMap,
}

impl PromptBuilder {
    /// An empty prompt for the model whose special ids are `tokens`
    /// (tenant 0, M-RoPE positions).
    pub fn new(tokens: OmniTokens) -> Self {
        Self {
            tokens,
            tenant: 0,
            kind: PositionKind::default(),
            atoms: Vec::new(),
            token_ids: Vec::new(),
            items: Vec::new(),
            index_map: IndexMap::default(),
        }
    }

    /// Sets the tenant salt: prompts of different tenants never share cache.
    pub fn with_tenant(mut self, tenant: TenantSalt) -> Self {
        self.tenant = tenant;
        self
    }

    /// Chooses 1-D or M-RoPE positions.
    pub fn with_positions(mut self, kind: PositionKind) -> Self {
        self.kind = kind;
        self
    }

    /// The model's special token ids.
    pub fn tokens(&self) -> &OmniTokens {
        &self.tokens
    }

    /// Number of positions so far.
    pub fn len(&self) -> usize {
        self.token_ids.len()
    }

    /// True before anything was pushed.
    pub fn is_empty(&self) -> bool {
        self.token_ids.is_empty()
    }

    /// Appends plain text ids (wrapper tokens such as `vision_start` are text).
    /// Placeholder ids are rejected here: items bring their own.
    pub fn push_text(&mut self, ids: &[u32]) -> Result<&mut Self> {
        if let Some((offset, _)) = find_placeholder(&self.tokens, ids) {
            return Err(RequestError::StrayPlaceholder {
                position: self.token_ids.len() + offset,
                token: ids[offset],
            }
            .into());
        }
        self.append_text(ids)
    }

    /// Appends text ids known to hold no placeholder (a scan found none):
    /// copies them once into the atoms and once into the ids. The vocabulary is
    /// admission's to check ([`RequestChecks`](crate::sched::RequestChecks)), against the model's config.
    fn append_text(&mut self, ids: &[u32]) -> Result<&mut Self> {
        self.check_room(ids.len())?;
        if ids.is_empty() {
            return Ok(self);
        }
        match self.atoms.last_mut() {
            Some(Atom::Text(run)) => run.extend_from_slice(ids),
            _ => self.atoms.push(Atom::Text(ids.to_vec())),
        }
        self.token_ids.extend_from_slice(ids);
        Ok(self)
    }

    /// Appends one item's placeholders (without wrapper tokens). An audio item
    /// cannot follow a video item directly: that layout means audio-in-video,
    /// which `push_audio_in_video` builds.
    pub fn push_item(&mut self, item: Arc<ItemIdentity>) -> Result<&mut Self> {
        let index = self.items.len();
        let count = self.tokens.checked_token_count(&item, index)?;
        if item.modality == Modality::Audio
            && let Some(Atom::Item { id, .. }) = self.atoms.last()
            && id.modality == Modality::Video
        {
            return Err(RequestError::MalformedAudioInVideo {
                item: index,
                position: self.len(),
                expected: "text between a video and a separate audio (or push_audio_in_video)".into(),
                found: "an audio item directly after a video item".into(),
            }
            .into());
        }
        self.check_room(count)?;
        self.items.push(item);
        self.push_span(index, 0..count as u32);
        Ok(self)
    }

    /// Appends a video and the audio of its soundtrack, their placeholders
    /// interleaved by time as the HF Qwen3-Omni processor emits them with
    /// `use_audio_in_video` (video first on ties), without wrapper tokens.
    pub fn push_audio_in_video(
        &mut self, video: Arc<ItemIdentity>, audio: Arc<ItemIdentity>,
    ) -> Result<&mut Self> {
        let (video_index, audio_index) = (self.items.len(), self.items.len() + 1);
        for (index, item, expected) in
            [(video_index, &video, Modality::Video), (audio_index, &audio, Modality::Audio)]
        {
            if item.modality != expected {
                return Err(RequestError::ItemModalityMismatch {
                    item: index,
                    expected,
                    found: item.modality,
                }
                .into());
            }
        }
        let video_tokens = self.tokens.checked_token_count(&video, video_index)?;
        let audio_tokens = self.tokens.checked_token_count(&audio, audio_index)?;
        self.check_room(video_tokens + audio_tokens)?;
        let runs = audio_in_video_runs(&video.layout, video_tokens as u32, audio_tokens as u32, &self.tokens);
        self.items.push(video);
        self.items.push(audio);
        for (modality, rows) in runs {
            let index = if modality == Modality::Video { video_index } else { audio_index };
            self.push_span(index, rows);
        }
        Ok(self)
    }

    /// The canonical prompt of everything pushed so far (the builder stays usable).
    pub fn build(&self) -> Result<CanonicalPrompt> {
        self.clone().into_prompt()
    }

    /// The canonical prompt, moving what was pushed instead of copying it
    /// (what preprocessing calls: a prompt's ids are copied once, not twice).
    pub fn into_prompt(self) -> Result<CanonicalPrompt> {
        if self.token_ids.is_empty() {
            return Err(RequestError::EmptyPrompt.into());
        }
        let positions = positions_from_atoms(&self.atoms, &self.tokens, self.kind)?;
        Ok(CanonicalPrompt {
            tenant: self.tenant,
            atoms: self.atoms,
            token_ids: self.token_ids,
            items: self.items,
            index_map: self.index_map,
            positions,
        })
    }

    /// Appends ids whose placeholders appear as `form` says. Each placeholder
    /// run takes the next unused item of its modality from `items`; every item
    /// must be used. Two items of one modality need a token between them (HF
    /// wraps each in start/end tokens anyway). One scan for placeholders, text
    /// between them appended as it is; a rejected request is rolled back, so it
    /// leaves `self` unchanged.
    pub fn extend(
        &mut self, ids: &[u32], items: &[Arc<ItemIdentity>], form: PlaceholderForm,
    ) -> Result<&mut Self> {
        for (index, item) in items.iter().enumerate() {
            self.tokens.checked_token_count(item, index)?;
        }
        let mark = self.mark();
        let result = self.extend_from(ids, items, form);
        if result.is_err() {
            self.rollback(mark);
        }
        result.map(|()| self)
    }

    fn extend_from(&mut self, ids: &[u32], items: &[Arc<ItemIdentity>], form: PlaceholderForm) -> Result<()> {
        let mut queues = ItemQueues::new(items);
        let mut text_start = 0;
        while let Some((found, modality)) = find_placeholder(&self.tokens, &ids[text_start..]) {
            let mut cursor = text_start + found;
            self.append_text(&ids[text_start..cursor])?;
            let (index, item) = queues.take(modality, self.len())?;
            cursor += match form {
                PlaceholderForm::Expanded => self.expanded_item(&ids[cursor..], index, item, &mut queues)?,
                PlaceholderForm::Unexpanded | PlaceholderForm::UnexpandedAudioInVideo => {
                    if modality == Modality::Video && form == PlaceholderForm::UnexpandedAudioInVideo {
                        self.unexpanded_audio_in_video(ids, cursor, index, item, &mut queues)?;
                    } else {
                        self.push_item(item)?;
                    }
                    1
                }
            };
            text_start = cursor;
        }
        self.append_text(&ids[text_start..])?;
        queues.check_all_used()
    }

    /// How long every part of the builder is now.
    fn mark(&self) -> Mark {
        let last_text = match self.atoms.last() {
            Some(Atom::Text(run)) => Some(run.len()),
            _ => None,
        };
        Mark {
            atoms: self.atoms.len(),
            last_text,
            token_ids: self.token_ids.len(),
            items: self.items.len(),
            spans: self.index_map.spans.len(),
        }
    }

    /// Cuts every part back to `mark` (pushes only ever append).
    fn rollback(&mut self, mark: Mark) {
        self.atoms.truncate(mark.atoms);
        if let (Some(len), Some(Atom::Text(run))) = (mark.last_text, self.atoms.last_mut()) {
            run.truncate(len);
        }
        let end = self.token_ids.len() as u32;
        self.index_map.placeholders.remove_range(mark.token_ids as u32..end.max(mark.token_ids as u32));
        self.token_ids.truncate(mark.token_ids);
        self.items.truncate(mark.items);
        self.index_map.spans.truncate(mark.spans);
    }

    /// Places one item from expanded ids starting at its first pad; returns
    /// how many ids it consumed.
    fn expanded_item(
        &mut self, ids: &[u32], index: usize, item: Arc<ItemIdentity>, queues: &mut ItemQueues,
    ) -> Result<usize> {
        let pad = self.tokens.pad_id(item.modality);
        let run = ids.iter().take_while(|&&t| t == pad).count();
        let audio_follows = ids.get(run) == Some(&self.tokens.audio_token_id);
        if item.modality == Modality::Video && audio_follows {
            let (_, audio) = queues.take(Modality::Audio, self.len() + run)?;
            let runs = audio_in_video_runs(
                &item.layout,
                item.num_tokens as u32,
                audio.num_tokens as u32,
                &self.tokens,
            );
            let mut offset = 0;
            for (modality, rows) in runs {
                for _ in rows {
                    let expected = self.tokens.pad_id(modality);
                    let found = ids.get(offset).copied();
                    if found != Some(expected) {
                        return Err(RequestError::MalformedAudioInVideo {
                            item: index,
                            position: self.len() + offset,
                            expected: format!("{modality:?} pad {expected}"),
                            found: found.map_or("end of prompt".into(), |t| format!("token {t}")),
                        }
                        .into());
                    }
                    offset += 1;
                }
            }
            self.push_audio_in_video(item, audio)?;
            return Ok(offset);
        }
        if run != item.num_tokens {
            return Err(RequestError::PlaceholderCountMismatch {
                item: index,
                position: self.len(),
                expected: item.num_tokens,
                found: run,
            }
            .into());
        }
        self.push_item(item)?;
        Ok(run)
    }

    /// Rewrites `vision_start video_pad vision_end` (pad at `ids[cursor]`) into
    /// the audio-in-video layout; the wrappers outside stay in the text.
    fn unexpanded_audio_in_video(
        &mut self, ids: &[u32], cursor: usize, index: usize, video: Arc<ItemIdentity>,
        queues: &mut ItemQueues,
    ) -> Result<()> {
        let before = cursor.checked_sub(1).and_then(|i| ids.get(i)).copied();
        let after = ids.get(cursor + 1).copied();
        if before != Some(self.tokens.vision_start_token_id) || after != Some(self.tokens.vision_end_token_id)
        {
            return Err(RequestError::MalformedAudioInVideo {
                item: index,
                position: self.len(),
                expected: "video pad between vision_start and vision_end".into(),
                found: format!("neighbours {before:?} and {after:?}"),
            }
            .into());
        }
        let (_, audio) = queues.take(Modality::Audio, self.len())?;
        self.push_text(&[self.tokens.audio_start_token_id])?;
        self.push_audio_in_video(video, audio)?;
        self.push_text(&[self.tokens.audio_end_token_id])?;
        Ok(())
    }

    /// Appends rows `rows` of item `index` at the end of the prompt.
    fn push_span(&mut self, index: usize, rows: std::ops::Range<u32>) {
        let item = Arc::clone(&self.items[index]);
        let start = self.token_ids.len() as u32;
        let len = rows.len() as u32;
        self.token_ids.extend(std::iter::repeat_n(self.tokens.pad_id(item.modality), len as usize));
        self.index_map.placeholders.insert_range(start..start + len);
        self.index_map.spans.push(ItemSpan { item: index as u32, rows: rows.clone(), start });
        self.atoms.push(Atom::Item { id: item, rows });
    }

    /// Positions are `u32` in the index map: refuse to grow past that.
    fn check_room(&self, extra: usize) -> Result<()> {
        let total = self.token_ids.len().saturating_add(extra);
        if u32::try_from(total).is_err() {
            return Err(RequestError::PromptTooLong { positions: total }.into());
        }
        Ok(())
    }
}

/// The lengths of a builder's parts before an `extend`, to undo it.
struct Mark {
    atoms: usize,
    /// Length of the last atom when it is a text run (an extend may grow it).
    last_text: Option<usize>,
    token_ids: usize,
    items: usize,
    spans: usize,
}

/// The first placeholder id in `ids`: its index and modality. Compares a
/// fixed group of 32 ids into a mask with no early exit, which the compiler
/// vectorises (a long text prompt costs a fraction of a nanosecond per id);
/// only a group with a hit is searched id by id.
fn find_placeholder(tokens: &OmniTokens, ids: &[u32]) -> Option<(usize, Modality)> {
    const GROUP: usize = 32;
    let pads = [tokens.image_token_id, tokens.video_token_id, tokens.audio_token_id];
    let hit = |t: u32| (t == pads[0]) | (t == pads[1]) | (t == pads[2]);
    let mut groups = ids.chunks_exact(GROUP);
    let mut offset = 0;
    let mut found = None;
    for group in &mut groups {
        let mut mask = [0u32; GROUP];
        for (m, &t) in mask.iter_mut().zip(group) {
            *m = u32::from(t == pads[0]) | u32::from(t == pads[1]) | u32::from(t == pads[2]);
        }
        if mask.iter().fold(0, |any, &m| any | m) != 0 {
            found = group.iter().position(|&t| hit(t)).map(|i| offset + i);
            break;
        }
        offset += GROUP;
    }
    let index = found.or_else(|| groups.remainder().iter().position(|&t| hit(t)).map(|i| offset + i))?;
    Some((index, tokens.placeholder_modality(ids[index])?))
}

/// How the items' placeholders appear in a request's token ids: the one way a
/// request says it (an audio-in-video request included).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PlaceholderForm {
    /// One pad id per item; preprocessing expands it to the item's token count.
    #[default]
    Unexpanded,
    /// Like `Unexpanded`, and every `vision_start video_pad vision_end` becomes
    /// `vision_start audio_start <interleaved video+audio> audio_end vision_end`,
    /// taking the next audio item too (Qwen3-Omni `use_audio_in_video`, the HF
    /// processor's rewrite).
    UnexpandedAudioInVideo,
    /// One pad id per item token, already expanded: each item's run of pads must
    /// be exactly its token count; a video run followed directly by audio pads is
    /// audio-in-video and must interleave as the HF processor does.
    Expanded,
}

/// The caller's items split by modality, consumed in order per modality.
struct ItemQueues<'a> {
    items: &'a [Arc<ItemIdentity>],
    /// Per modality (image, video, audio): indices into `items`, and how many are used.
    indices: [Vec<usize>; 3],
    used: [usize; 3],
}

const MODALITIES: [Modality; 3] = [Modality::Image, Modality::Video, Modality::Audio];

fn slot(modality: Modality) -> usize {
    match modality {
        Modality::Image => 0,
        Modality::Video => 1,
        Modality::Audio => 2,
    }
}

impl<'a> ItemQueues<'a> {
    fn new(items: &'a [Arc<ItemIdentity>]) -> Self {
        let mut indices: [Vec<usize>; 3] = Default::default();
        for (index, item) in items.iter().enumerate() {
            indices[slot(item.modality)].push(index);
        }
        Self { items, indices, used: [0; 3] }
    }

    /// The next unused item of `modality`, for a placeholder at `position`.
    fn take(&mut self, modality: Modality, position: usize) -> Result<(usize, Arc<ItemIdentity>)> {
        let s = slot(modality);
        let index = *self.indices[s].get(self.used[s]).ok_or(RequestError::MissingItem {
            position,
            modality,
            available: self.indices[s].len(),
        })?;
        self.used[s] += 1;
        Ok((index, Arc::clone(&self.items[index])))
    }

    fn check_all_used(&self) -> Result<()> {
        for modality in MODALITIES {
            let s = slot(modality);
            if let Some(&first) = self.indices[s].get(self.used[s]) {
                return Err(RequestError::UnusedItems {
                    first,
                    modality,
                    count: self.indices[s].len() - self.used[s],
                }
                .into());
            }
        }
        Ok(())
    }
}
