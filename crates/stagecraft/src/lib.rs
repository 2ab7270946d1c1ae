//! stagecraft
