package idemhttp

// PresetHeaders are the signature, timestamp, id and event headers preset
// names: the headers a delivery must carry at most once (repeatedHeader).
func PresetHeaders(p Preset) []string {
	var c Config
	p(&c)
	return c.senderHeaders
}
