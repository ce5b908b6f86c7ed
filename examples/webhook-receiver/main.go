// Command webhook-receiver serves the example Stripe receiver on $ADDR
// (default :8080), verifying deliveries with $STRIPE_WEBHOOK_SECRET (the
// endpoint's signing secret, "whsec_..."; several separated by commas
// while one is rolled). It charges the platform fee at $PAYMENTS_URL and
// mails receipts through $MAIL_URL (without them, an in-process stub).
//
//	DATABASE_URL=postgres://... STRIPE_WEBHOOK_SECRET=whsec_... go run ./examples/webhook-receiver
package main

import (
	"context"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/examples/webhook-receiver/receiver"
	"github.com/idemkit/idem/migrate"

	"github.com/jackc/pgx/v5/stdlib"
)

func main() {
	secrets := strings.Split(os.Getenv("STRIPE_WEBHOOK_SECRET"), ",")
	if secrets[0] == "" {
		log.Fatal("STRIPE_WEBHOOK_SECRET is not set: give the endpoint's signing secret (whsec_...) from the Stripe dashboard or `stripe listen`")
	}
	addr := os.Getenv("ADDR")
	if addr == "" {
		addr = ":8080"
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := migrate.Up(ctx, stdlib.OpenDBFromPool(pool)); err != nil {
		log.Fatal(err)
	}
	if err := receiver.Setup(ctx, pool); err != nil {
		log.Fatal(err)
	}
	api, err := outbound()
	if err != nil {
		log.Fatal(err)
	}
	c, err := idem.New(pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	rc := &receiver.Receiver{Pool: pool, Idem: c, API: api}
	h, err := rc.Handler(nil, secrets...)
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /webhooks/stripe", h)
	srv := &http.Server{Addr: addr, Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	log.Printf("listening on %s", srv.Addr)
	if err := srv.ListenAndServe(); err != nil && err != http.ErrServerClosed {
		log.Fatal(err)
	}
}

// outbound calls the payment provider at $PAYMENTS_URL and the mail API at
// $MAIL_URL; without them, both are the in-process stub on a local port.
func outbound() (*receiver.API, error) {
	payments, mail := os.Getenv("PAYMENTS_URL"), os.Getenv("MAIL_URL")
	if payments == "" || mail == "" {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		go func() { _ = http.Serve(ln, &receiver.Stub{}) }()
		stub := "http://" + ln.Addr().String()
		log.Printf("PAYMENTS_URL or MAIL_URL unset: calling the stub provider at %s", stub)
		payments, mail = stub, stub
	}
	return receiver.NewAPI(payments, mail)
}
