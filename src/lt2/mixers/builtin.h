// The registry entry of every built-in mixer (defined beside each mixer).
#pragma once
#include "lt2/mixers/registry.h"

namespace lt2 {

MixerInfo full_attention_info();  // mixers/full_attention.cpp

}  // namespace lt2
