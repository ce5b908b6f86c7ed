package testdb

import (
	"fmt"
	"os"
	"os/exec"
	"sync"
	"testing"
)

var chromium struct {
	once sync.Once
	path string
	err  error
}

// Chromium returns the path of a headless-capable Chromium (Debian's
// chromium package), installing it with apt-get when it is missing and the
// tests run as root (as .ci/run does); otherwise the test fails saying how
// to install it. The dashboard's browser tests need it.
func Chromium(t testing.TB) string {
	t.Helper()
	chromium.once.Do(func() { chromium.path, chromium.err = chromiumBinary() })
	if chromium.err != nil {
		t.Fatal(chromium.err)
	}
	return chromium.path
}

func chromiumBinary() (string, error) {
	look := func() (string, bool) {
		for _, p := range []string{"chromium", "chromium-browser", "/usr/bin/chromium", "google-chrome"} {
			if path, err := exec.LookPath(p); err == nil {
				return path, true
			}
		}
		return "", false
	}
	if path, ok := look(); ok {
		return path, nil
	}
	if os.Geteuid() == 0 {
		if _, err := exec.LookPath("apt-get"); err == nil {
			cmd := exec.Command("sh", "-c", "apt-get install -y -qq chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium)")
			cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
			if out, err := cmd.CombinedOutput(); err != nil {
				return "", fmt.Errorf("chromium is not installed and apt-get install chromium failed: %v\n%s", err, out)
			}
			if path, ok := look(); ok {
				return path, nil
			}
		}
	}
	return "", fmt.Errorf("chromium is not installed: apt-get install chromium (the dashboard's browser tests drive it)")
}
