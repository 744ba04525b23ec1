// Packed documents through any mixer (Positions::documents): a mixer that serves them itself
// (MixerCaps::packed_documents) gets them; any other runs each document alone.
#pragma once
#include "lt2/mixers/mixer.h"

namespace lt2 {

// The parallel forward of `mixer` on x [B, T, d] (mixer.forward(x, pos, state)), where with
// pos.documents no token sees another document: the mixer's own path when it has one, otherwise
// one call per document of each row, from position 0 without a state, the outputs put back in
// place. Packed documents take no state (training, a whole row at once).
Tensor mixer_forward(MixerImpl& mixer, const Tensor& x, const Positions& pos, MixerState* state = nullptr);

}  // namespace lt2
