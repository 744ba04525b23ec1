// The registry entry of every built-in mixer (defined beside each mixer).
#pragma once
#include "lt2/mixers/registry.h"

namespace lt2 {

MixerInfo full_attention_info();  // mixers/full_attention.cpp
MixerInfo window_attention_info();  // mixers/window.cpp
MixerInfo dsa_info();             // mixers/dsa.cpp
MixerInfo nsa_info();             // mixers/nsa.cpp
MixerInfo gdn_info();             // mixers/gdn.cpp
MixerInfo kda_info();             // mixers/kda.cpp
MixerInfo mamba2_info();          // mixers/mamba2.cpp
MixerInfo retnet_info();          // mixers/retnet.cpp
MixerInfo deltanet_info();        // mixers/deltanet.cpp
MixerInfo gla_info();             // mixers/gla.cpp
MixerInfo hgrn2_info();           // mixers/hgrn2.cpp
MixerInfo linear_attention_info();  // mixers/linear_attention.cpp

}  // namespace lt2
